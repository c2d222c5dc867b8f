"""Whole jobs under faults, on the session's in-process Ray: a storage outage mid-run
(item 4), SIGTERM mid-run (item 8), a held lease (item 9), a resume with another config
(item 10), secrets kept out of every output and log (item 1)."""

import io
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.config import ConfigError, build_config
from pipeline.driver import main_guarded, run_job
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, EXIT_OUTPUT_BUSY, EXIT_STORAGE_UNAVAILABLE
from pipeline.history import run_records
from pipeline.lease import LEASE_KEY, Lease
from pipeline.ledger import read_telemetry
from pipeline.storage import open_storage
from pipeline_helpers import live_pool_actors, simple_rows, write_prompts

FAST = {"method": "ar", "temperature": 0.0}


def job(tmp_path, input, **over):
    data = {"job_id": "t", "bundle": "random:0", "input": str(input), "output": str(tmp_path / "out"),
            "num_actors": 1, "batch_size": 2, "decode": FAST, "progress": False}
    data.update(over)
    return build_config(data)


def _when(cond, then, poll_s=0.05, limit_s=120):
    """Run `then()` in a thread as soon as `cond()` holds (polling a condition)."""
    def watch():
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if cond():
                then()
                return
            time.sleep(poll_s)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_storage_outage_mid_job_exits_4_and_resume_finishes(tmp_path, ray_session, proxy, s3):
    rows = simple_rows(20)  # the store is cut at the first image
    src = write_prompts(tmp_path / "p.parquet", rows)
    storage = {"endpoint_url": proxy.endpoint, "retry_budget_s": 1.0, "timeout_s": 2.0}
    out_uri = f"s3://{s3.bucket}/run"
    cfg = job(tmp_path, src, output=out_uri, storage=storage, lease_ttl_s=5)
    images = lambda: s3.client.list_objects_v2(Bucket=s3.bucket, Prefix="run/images/").get("KeyCount", 0)  # noqa: E731
    watcher = _when(lambda: images() > 0, proxy.cut)
    out = io.StringIO()
    before = live_pool_actors()
    res = run_job(cfg, stream=out)
    watcher.join()
    assert res.exit_code == EXIT_STORAGE_UNAVAILABLE, out.getvalue()[-2000:]
    assert not live_pool_actors() - before  # its pool's actors are gone: the resume below gets their CPUs
    text = out.getvalue()
    assert "storage unavailable" in text and "summary   (not written: storage unavailable)" in text
    proxy.restore()
    store = open_storage(out_uri, cfg.storage)
    durable = read_telemetry(store)
    assert (durable.num_rows if durable is not None else 0) == res.summary["durable_rows"]
    # the lease could not be released while the store was down: it lapses after lease_ttl_s
    again = run_job(cfg.model_copy(update={"resume": True, "lease_wait_s": 10.0}), stream=io.StringIO())
    assert again.exit_code in (EXIT_OK, 1)
    assert again.summary["job_ok"] + again.summary["job_failed"] == len(rows)
    rerun = run_job(job(tmp_path, src, output=out_uri, storage=storage, resume=True), stream=io.StringIO())
    assert rerun.exit_code == EXIT_OK and rerun.summary["job_ok"] == len(rows)
    assert not store.exists(LEASE_KEY)


def test_sigterm_mid_job_ends_cleanly_with_a_summary(tmp_path, ray_session):
    rows = simple_rows(30)  # SIGTERM at the first durable rows (~1 s in): ~2 s of work still left
    src = write_prompts(tmp_path / "p.parquet", rows)
    tel_dir = tmp_path / "out" / "telemetry"
    previous = signal.signal(signal.SIGTERM, lambda *a: None)  # a late signal must not end pytest
    try:  # SIGTERM once the first batch of rows is durable
        watcher = _when(lambda: tel_dir.is_dir() and any(tel_dir.glob("*.parquet")),
                        lambda: os.kill(os.getpid(), signal.SIGTERM))
        res = run_job(job(tmp_path, src), stream=io.StringIO())
        watcher.join()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert res.exit_code == EXIT_INTERRUPTED
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "SIGTERM" in summary["error"]
    durable = read_telemetry(open_storage(str(tmp_path / "out")))
    assert 0 < durable.num_rows == summary["durable_rows"] == summary["processed"] < len(rows)
    assert not (tmp_path / "out" / LEASE_KEY).exists()
    done = run_job(job(tmp_path, src, resume=True), stream=io.StringIO())
    assert done.exit_code == EXIT_OK and done.summary["job_ok"] == len(rows)
    tel = read_telemetry(open_storage(str(tmp_path / "out")), columns=["prompt_id", "status"]).to_pylist()
    assert Counter(r["prompt_id"] for r in tel if r["status"] == "ok") == Counter(r["prompt_id"] for r in rows)


def test_held_lease_refuses_a_second_job(tmp_path):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(3))
    other = Lease(open_storage(str(tmp_path / "out")), "other-job/run-1", ttl_s=600)
    other.acquire()
    try:
        err = io.StringIO()
        assert main_guarded(job(tmp_path, src), stream=io.StringIO(), err=err) == EXIT_OUTPUT_BUSY
        assert "in use by job other-job/run-1" in err.getvalue() and "--lease-wait-s" in err.getvalue()
        assert not (tmp_path / "out" / "job.json").exists()
    finally:
        other.release()


def test_resume_with_another_config_is_refused_and_history_kept(tmp_path, ray_session):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(4))
    first = run_job(job(tmp_path, src, limit=2), stream=io.StringIO())
    assert first.exit_code == EXIT_OK
    job_json = (tmp_path / "out" / "job.json").read_text()
    err = io.StringIO()
    changed = job(tmp_path, src, resume=True, decode={**FAST, "temperature": 0.5})
    assert main_guarded(changed, stream=io.StringIO(), err=err) == EXIT_BAD_INPUT
    assert "decode.temperature" in err.getvalue() and "--allow-config-change" in err.getvalue()
    allowed = run_job(changed.model_copy(update={"allow_config_change": True}), stream=io.StringIO())
    assert allowed.exit_code == EXIT_OK and allowed.summary["job_ok"] == 4
    assert (tmp_path / "out" / "job.json").read_text() == job_json  # the first config stays
    records = run_records(open_storage(str(tmp_path / "out")))
    assert [r["config_hash"] for r in records] == [first.summary["config_hash"], allowed.summary["config_hash"]]
    assert records[1]["changed_from"]["fields"] == ["decode.temperature"] and records[1]["exit_code"] == 0


SECRET = "S3cr3t-" + os.urandom(6).hex()


def test_secrets_never_reach_outputs_or_ray_logs(tmp_path, ray_session, s3, monkeypatch, capfd):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)  # the driver's own credential
    src = write_prompts(tmp_path / "p.parquet", simple_rows(3))
    with pytest.raises(ConfigError) as refused:
        job(tmp_path, src, output=f"s3://{s3.bucket}/leak",
            storage={"endpoint_url": s3.endpoint.replace("http://", f"http://admin:{SECRET}@")})
    assert "storage.endpoint_url" in str(refused.value) and SECRET not in str(refused.value)
    err = io.StringIO()
    out = io.StringIO()
    res = run_job(job(tmp_path, src, output=f"s3://{s3.bucket}/ok", storage={"endpoint_url": s3.endpoint}), stream=out)
    assert res.exit_code == EXIT_OK
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket).get("Contents", [])]
    assert any(k.endswith("job.json") for k in keys)
    for key in keys:
        assert SECRET.encode() not in s3.client.get_object(Bucket=s3.bucket, Key=key)["Body"].read(), key
    assert SECRET not in out.getvalue() + err.getvalue() + "".join(capfd.readouterr())
    from ray._private.worker import _global_node

    logs = Path(_global_node.get_session_dir_path()) / "logs"
    leaked = [p for p in logs.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []
