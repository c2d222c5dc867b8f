"""jobs.train_drafter end to end on a tiny random bundle: real local Ray, real Ray Train workers
(2 CPU workers, DDP over gloo), real Parquet from the project's batch job, checkpoints on a local
folder and on the loopback moto S3 server; a killed worker (checkpoints on S3) and a killed driver
(checkpoints in a local folder) resume from the last checkpoint and end where an uninterrupted run
ends."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from jobs import train_drafter
from jobs.train.ray_train import FAULT_ENV

ROOT = Path(__file__).resolve().parents[2]
DUMMY_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
             "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
STEPS = 12
TINY = ["--steps", str(STEPS), "--num-workers", "2",
        "--set", "train.batch_size=4", "--set", "train.ckpt_every=5", "--set", "train.log_every=2",
        "--set", "train.eval_every=6", "--set", "distill.heldout_fraction=0.2", "--set", "distill.decode_batch_size=8",
        "--set", "train.warmup=2"]
NO_EVAL = ["--set", "eval.limit=0"]
# Ray Train's controller takes a worker's report (its result queue holds one) and notices a dead
# worker or a finished run only when it polls, every 2 s by default: most of a 12-step run's
# time. Polling faster changes when the controller looks, not what it does (a missed poll is
# only an error after the 10-minute health-check timeout). Ray reads this from the driver's
# environment and hands it to the controller.
FAST_POLL = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}


@pytest.fixture(scope="module", autouse=True)
def fast_train_polls():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in FAST_POLL.items():
            mp.setenv(k, v)
        yield


@pytest.fixture(scope="module")
def ray_local(ray_session):
    """The session's in-process Ray (its workers get DUMMY_AWS), dummy credentials here too."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in DUMMY_AWS.items():
            mp.setenv(k, v)
        yield ray_session


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.parquet"
    n = 24
    pq.write_table(pa.table({"prompt_id": [f"p{i:03d}" for i in range(n)],
                             "prompt": [f"a tiny prompt number {i % 8}" for i in range(n)],
                             "seed": pa.array(range(n), pa.int64())}), path)
    return path


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    """A tiny random bundle directory (8x8 grid, 64 codes), as save_bundle writes it."""
    from adt_core import random_bundle, save_bundle

    return save_bundle(random_bundle(seed=0), tmp_path_factory.mktemp("bundle") / "tiny")


@pytest.fixture(scope="module")
def baseline(ray_local, prompts, bundle_dir, tmp_path_factory) -> Path:
    """One uninterrupted run: data made by the batch job, 2 workers, evaluation, export."""
    out = tmp_path_factory.mktemp("baseline") / "out"
    code = train_drafter.main(TINY + ["--bundle", str(bundle_dir), "--prompts", str(prompts), "--out", str(out), "--set", "eval.limit=2",
                                      "--set", "eval.max_tokens=8", "--set", "eval.methods=[eagle2]"])
    assert code == 0
    return out


def _reader(out):
    """key -> bytes of a run's output: a local folder (Path) or an S3 prefix (client, bucket, prefix)."""
    if isinstance(out, Path):
        return lambda key: (out / key).read_bytes()
    client, bucket, prefix = out
    return lambda key: client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()


def final_state(out) -> dict:
    read = _reader(out)
    snap = json.loads(read("train/checkpoint_manager_snapshot.json"))
    name = snap["latest_checkpoint_result"]["checkpoint_dir_name"]
    return torch.load(io.BytesIO(read(f"train/{name}/state.pt")), weights_only=True)


def metric_steps(out) -> list[int]:
    return [json.loads(line)["step"] for line in _reader(out)("metrics.jsonl").decode().splitlines()]


@pytest.fixture(scope="module")
def killed_on_s3(baseline, bundle_dir, moto_endpoint, tmp_path_factory) -> SimpleNamespace:
    """One run with its checkpoints on the loopback S3 server whose rank-1 worker SIGKILLs itself
    once at step 7: Ray Train restarts the worker group from the step-5 checkpoint on S3. The
    worker-kill test and the S3 test both read this run (each run costs a controller and a
    worker group's start-up: the S3 layout needs no run of its own)."""
    import boto3

    marker = tmp_path_factory.mktemp("killed") / "killed"
    bucket = "train-" + uuid.uuid4().hex[:10]
    with pytest.MonkeyPatch.context() as mp:
        for k, v in DUMMY_AWS.items():
            mp.setenv(k, v)
        mp.setenv(FAULT_ENV, f"kill:1:7:{marker}")  # rank 1 SIGKILLs itself once, at step 7
        client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        code = train_drafter.main(TINY + NO_EVAL + ["--bundle", str(bundle_dir), "--data", str(baseline / "data"),
                                                    "--out", f"s3://{bucket}/run",
                                                    "--set", f"storage.endpoint_url={moto_endpoint}",
                                                    "--set", "export_bundle=false"])
    return SimpleNamespace(code=code, marker=marker, client=client, bucket=bucket, out=(client, bucket, "run"))


def test_two_workers_end_to_end(baseline):
    from adt_core import load_bundle

    result = json.loads((baseline / "result.json").read_text())
    assert result["status"] == "done" and result["steps"] == STEPS
    saved = json.loads((baseline / "train_config.json").read_text())
    assert saved["train"]["steps"] == STEPS and saved["config_hash"] == result["config_hash"]
    # the batch job drew the training images: telemetry with token grids, method ar
    tele = pq.read_table(baseline / "data" / "telemetry", columns=["status", "method", "tokens"])
    assert set(tele["method"].to_pylist()) == {"ar"} and set(tele["status"].to_pylist()) == {"ok"}
    # progress through ray.train.report and metrics.jsonl; two workers each step
    steps = metric_steps(baseline)
    assert steps == sorted(set(steps)) and steps[-1] == STEPS
    last = json.loads((baseline / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["workers"] == 2 and {"smooth_l1", "soft_ce", "heldout_agree_cond"} <= set(last)
    # the export: an fp16 component that load_bundle takes, evaluation in its provenance
    weights = load_file(str(baseline / "drafter" / "model.safetensors"))
    assert all(v.dtype == torch.float16 for v in weights.values() if v.is_floating_point())
    prov = json.loads((baseline / "drafter" / "provenance.json").read_text())
    assert {(r["method"], r["temperature"]) for r in prov["evaluation"]} == {("eagle2", 0.0), ("eagle2", "default")}
    assert all(r["mean_acceptance_length"] >= 1.0 for r in prov["evaluation"])
    bundle = load_bundle(baseline / "bundle")
    state = final_state(baseline)
    for k, v in bundle.drafter.state_dict().items():
        torch.testing.assert_close(v.float(), state["model"][k].half().float())


def test_worker_killed_mid_run_resumes(baseline, killed_on_s3):
    assert killed_on_s3.code == 0
    assert killed_on_s3.marker.exists(), "the worker was not killed"
    out = killed_on_s3.out
    state, ref = final_state(out), final_state(baseline)
    assert state["step"] == ref["step"] == STEPS
    for k in ref["model"]:  # resumed from step 5: the same batches, noise and moments
        torch.testing.assert_close(state["model"][k], ref["model"][k], rtol=1e-5, atol=1e-6)
    assert metric_steps(out) == metric_steps(baseline)


def _driver(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobs.train_drafter", *args], cwd=ROOT, env=env,
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def test_driver_stopped_by_sigterm_exits_6_in_one_line_and_resumes(baseline, bundle_dir, tmp_path):
    """SIGTERM (a scheduler's stop; what a preempted node gets first) to the real driver mid-run:
    exit 6 with one line, no traceback; the same command then resumes from a checkpoint recorded
    before the stop and ends with the uninterrupted run's weights."""
    out = tmp_path / "out"
    log = tmp_path / "driver.log"
    temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # the drivers' local Ray (short: socket paths have a limit)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | DUMMY_AWS | FAST_POLL | {"RAY_TMPDIR": temp}
    args = TINY + NO_EVAL + ["--bundle", str(bundle_dir), "--data", str(baseline / "data"), "--out", str(out),
                             "--ray-address", "local"]
    proc = _driver(args, env | {FAULT_ENV: "delay:0.5"}, log)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and m.read_text().strip() and metric_steps(out)[-1] >= 6 and _checkpoint_recorded(out):
                break
            time.sleep(0.2)
        assert proc.poll() is None, f"driver ended early: {log.read_text()[-3000:]}"
        os.kill(proc.pid, signal.SIGTERM)  # the driver
        stopped = proc.wait(60)
    finally:
        _reap(proc, temp)  # and at once its local Ray: nothing of the run goes on once killed_at is read
    killed_at = metric_steps(out)[-1]
    text = log.read_text()
    errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
    assert stopped == 6 and errors == ["error: interrupted; run the same command again to resume"], text[-3000:]
    assert not any(ln.startswith("Traceback") for ln in text.splitlines())  # the driver's own (Ray's actors' are prefixed)
    assert 6 <= killed_at < STEPS and not (out / "result.json").exists()
    proc = _driver(args, env, log)
    try:
        assert proc.wait(300) == 0, log.read_text()[-3000:]
    finally:
        _reap(proc, temp)
        shutil.rmtree(temp, ignore_errors=True)
    resumed = int(json.loads((out / "resumed.json").read_text())["step"])  # the log's line may not be forwarded
    assert resumed in (5, 10) and resumed <= killed_at  # a checkpoint recorded before the kill
    state, ref = final_state(out), final_state(baseline)
    assert state["step"] == ref["step"] == STEPS
    for k in ref["model"]:
        torch.testing.assert_close(state["model"][k], ref["model"][k], rtol=1e-5, atol=1e-6)
    assert metric_steps(out) == metric_steps(baseline)
    assert json.loads((out / "result.json").read_text())["steps"] == STEPS


def test_another_config_into_a_finished_output_is_refused(baseline, bundle_dir, prompts, capsys):
    """A finished OUT and a changed --steps: exit 2 naming the saved config, not the old drafter."""
    code = train_drafter.main(TINY + ["--bundle", str(bundle_dir), "--prompts", str(prompts), "--out", str(baseline),
                                      "--set", "eval.limit=2", "--set", "eval.max_tokens=8",
                                      "--set", "eval.methods=[eagle2]", "--set", f"train.steps={STEPS * 2}"])
    err = capsys.readouterr().err
    assert code == 2 and "holds a run with another config" in err and "choose another --out" in err


def _checkpoint_recorded(out) -> bool:
    """True once Ray Train's controller has recorded a checkpoint in its snapshot (what a restarted
    driver resumes from; a checkpoint directory alone is not enough: under load the driver can die
    between a worker's report and the controller's snapshot, and the rerun then starts afresh)."""
    snap = out / "train" / "checkpoint_manager_snapshot.json"
    try:
        return bool(json.loads(snap.read_text()).get("checkpoint_results"))
    except (OSError, ValueError):
        return False


def _reap(proc: subprocess.Popen, temp: str) -> None:
    """Stop what the test started: the driver's process group, then by PID every process of its
    local Ray (each names `temp`, the Ray temp dir, in its command line or environment; the
    workers have process groups of their own and outlive a killed driver by seconds), and wait
    until they are gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    deadline = time.monotonic() + 30
    while (pids := _pids_mentioning(temp)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def _pids_mentioning(marker: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if marker.encode() in (d / "cmdline").read_bytes() or marker.encode() in (d / "environ").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_checkpoints_on_loopback_s3(killed_on_s3):
    client, bucket = killed_on_s3.client, killed_on_s3.bucket
    assert killed_on_s3.code == 0
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]}
    assert {"run/result.json", "run/train_config.json", "run/metrics.jsonl", "run/drafter/model.safetensors",
            "run/drafter/config.json", "run/train/checkpoint_manager_snapshot.json"} <= keys
    assert any(k.startswith("run/train/checkpoint_") and k.endswith("/state.pt") for k in keys)
    result = json.loads(client.get_object(Bucket=bucket, Key="run/result.json")["Body"].read())
    assert result["steps"] == STEPS and "testing" not in json.dumps(result)


# ---------------------------------------------------------------- bad input: one line, a documented code


def _telemetry(path: Path, rows: list[dict]) -> Path:
    from pipeline.telemetry import to_table

    (path / "telemetry").mkdir(parents=True)
    base = {"finished_at": None, "grid_h": 8, "grid_w": 8, "seed": 0, "error": None}
    pq.write_table(to_table([base | r for r in rows]), path / "telemetry" / "part.parquet")
    return path


def _refused(capsys, args: list[str], code: int, words: str, out: Path) -> None:
    assert train_drafter.main(args) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert not (out / "result.json").exists() and not (out / "drafter").exists()
    assert code in train_drafter.EXIT_CODES


def test_bad_data_exits(ray_local, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    base = TINY + NO_EVAL + ["--bundle", "random:0"]
    _refused(capsys, base + ["--data", str(empty), "--out", str(tmp_path / "o1")], 8, "empty", tmp_path / "o1")
    failed = _telemetry(tmp_path / "failed", [{"prompt_id": f"p{i}", "prompt": "x", "status": "failed",
                                                "error": "boom"} for i in range(3)])
    _refused(capsys, base + ["--data", str(failed), "--out", str(tmp_path / "o2")], 8, "all 3 rows", tmp_path / "o2")
    grid = [5] * 63 + [64]  # random:0 has a codebook of 64 codes
    wild = _telemetry(tmp_path / "wild", [{"prompt_id": "p0", "prompt": "x", "status": "ok", "tokens": grid}])
    _refused(capsys, base + ["--data", str(wild), "--out", str(tmp_path / "o3")], 8, "outside the codebook",
             tmp_path / "o3")


def test_bundle_without_a_drafter_head_exits(tmp_path, capsys, monkeypatch):
    import dataclasses

    import pipeline.worker
    from adt_core import random_bundle
    from adt_core.families import registry

    # a family registered from outside with no training head type (Family.train_head None)
    monkeypatch.setitem(registry._FAMILIES, "headless", lambda: registry.Family(name="headless"))
    other = dataclasses.replace(random_bundle(), family="headless")
    monkeypatch.setattr(pipeline.worker, "load_bundle_spec", lambda spec, storage=None: other)
    out = tmp_path / "out"
    _refused(capsys, TINY + ["--bundle", "random:0", "--prompts", "p.parquet", "--out", str(out)], 9, "no drafter head type", out)
    assert not out.exists()


def test_unwritable_output_exits(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "out"
    _refused(capsys, TINY + ["--bundle", "random:0", "--prompts", "p.parquet", "--out", str(out)], 4, "not writable", out)


def test_config_refused(capsys):
    assert train_drafter.main(["--bundle", "random:0", "--out", "x"]) == 2  # neither prompts nor data
    assert "--prompts" in capsys.readouterr().err
    assert train_drafter.main(TINY + ["--bundle", "random:0", "--prompts", "p", "--out", "x",
                                      "--set", "train.stepz=3"]) == 2
    assert "train.stepz: unknown field" in capsys.readouterr().err


def test_emoji16_recipe_is_a_valid_config():
    cfg = train_drafter.load_config(str(ROOT / "jobs/train/recipes/emoji16.yaml"), {"prompts": "p.parquet", "out": "o"})
    assert cfg.bundle == "emoji16" and cfg.num_workers == 2 and cfg.train.batch_size % cfg.num_workers == 0
    assert cfg.eval.prompts == "examples/prompts.parquet" and cfg.eval.methods == ["eagle2", "adt"]
