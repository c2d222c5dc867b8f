"""jobs.report over real job outputs (a tiny random-bundle job on an in-process Ray, in a local
folder and on the loopback S3 server) and over a synthetic 100k-row telemetry table."""

from __future__ import annotations

import base64
import datetime as dt
import io
import re
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("matplotlib")

from jobs.report import job_store, main as report_main, make_report  # noqa: E402
from pipeline.config import StorageSettings, build_config  # noqa: E402
from pipeline.driver import run_job  # noqa: E402
from pipeline.storage import LocalStorage  # noqa: E402
from pipeline.telemetry import SCHEMA  # noqa: E402

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
       "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
       "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials"}
TREE = {"method": "eagle2", "temperature": 0.0, "tree": {"depth": 3, "top_k": 2, "budget": 6}}
CHARTS = ["status", "throughput", "time", "speedup", "acceptance", "tree_maps", "tree_singles", "samples"]


@pytest.fixture(scope="module")
def ray_local(ray_session):
    """The session's in-process Ray (its workers get the dummy credentials), AWS here too."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in AWS.items():
            mp.setenv(k, v)
        yield ray_session


def _prompts(path, n_ok: int, bad: int):
    rows = [{"prompt_id": f"p{i:02d}", "prompt": f"a smiling face number {i}", "seed": i} for i in range(n_ok)]
    rows += [{"prompt_id": f"bad{i}", "prompt": "", "seed": 1} for i in range(bad)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _job(tmp_path, output, **over):
    data = {"job_id": "rep", "bundle": "random:0", "input": _prompts(tmp_path / "prompts.parquet", 6, over.pop("bad", 0)),
            "output": output, "num_actors": 1, "batch_size": 3, "decode": TREE, "progress": False,
            "allow_failures": True}
    data.update(over)
    return build_config(data)


def _check_page(out, failures: bool):
    page = (out / "index.html").read_text()
    from PIL import Image

    pngs = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    assert len(pngs) == len(CHARTS)
    for name, b64 in zip(CHARTS, pngs):
        data = base64.b64decode(b64)
        assert data == (out / f"report_{name}.png").read_bytes()
        img = Image.open(io.BytesIO(data)).convert("L")
        assert img.width > 300 and img.height > 100
        assert np.asarray(img).std() > 5, f"{name} looks blank"
        assert f"id='{name}'" in page
    md = (out / "report.md").read_text()
    assert all(f"report_{n}.png" in md for n in CHARTS)
    assert ("invalid prompt" in md) == failures
    assert "Job config (job.json)" in page and "random:0" in page
    return page, md


def test_report_local_job_with_failures_and_baseline(tmp_path, ray_local):
    res = run_job(_job(tmp_path, str(tmp_path / "out"), bad=2, baseline_fraction=0.5), stream=io.StringIO())
    assert res.summary["ok"] == 6 and res.summary["failed"] == 2
    assert report_main([str(tmp_path / "out"), "--out", str(tmp_path / "rep")]) == 0
    page, md = _check_page(tmp_path / "rep", failures=True)
    assert "| 2 | invalid prompt" in md
    row = re.search(r"\| measured speedup vs ar \| (\d+) \|", md)
    assert row and int(row.group(1)) >= 1  # baseline rows were measured and reported


def test_report_s3_job_without_baseline(tmp_path, ray_local, moto_endpoint):
    import boto3

    bucket = "rep-" + uuid.uuid4().hex[:10]
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/runs/j1"
    out = io.StringIO()
    res = run_job(_job(tmp_path, uri, storage={"endpoint_url": moto_endpoint, "retry_budget_s": 7.0}), stream=out)
    assert res.exit_code == 0 and res.summary["ok"] == 6
    assert f"python -m jobs.report {uri} --endpoint-url {moto_endpoint}" in out.getvalue()  # the hint runs as printed
    rep = make_report(uri, tmp_path / "rep", StorageSettings(endpoint_url=moto_endpoint))
    assert [c.name for c in rep.charts] == CHARTS
    page, md = _check_page(tmp_path / "rep", failures=False)
    assert "| measured speedup vs ar | 0 |" in md and "failed 0" in md
    # no flags, the endpoint from the AWS environment: job.json is read first and its settings serve the rest
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", moto_endpoint)
        assert job_store(uri).opts.retry_budget_s == 7.0
        assert report_main([uri, "--out", str(tmp_path / "rep2"), "--samples", "2"]) == 0
    assert (tmp_path / "rep2" / "index.html").exists()


def test_report_unreachable_store_exits_4_in_one_line(capsys, monkeypatch, aws_env):
    import socket

    import jobs.report

    monkeypatch.setattr(jobs.report, "PROBE_BUDGET_S", 0.3)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert report_main(["s3://nowhere/run", "--endpoint-url", f"http://127.0.0.1:{port}"]) == 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--endpoint-url" in err and "AWS_ENDPOINT_URL" in err and "Traceback" not in err


def _synthetic(n: int, grid=(8, 8)) -> pa.Table:
    rng = np.random.default_rng(0)
    h, w = grid
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    acc = rng.integers(0, 4, size=(n, 20)).astype(np.int16)
    pos = np.minimum(np.cumsum(np.concatenate([np.ones((n, 1), int), acc[:, :-1] + 1], axis=1), axis=1), h * w - 1)
    rounds = pa.ListArray.from_arrays(
        pa.array(np.arange(0, 20 * n + 1, 20, dtype=np.int32)),
        pa.StructArray.from_arrays(
            [pa.array(pos.ravel().astype(np.int32)), pa.array(rng.integers(1, 6, 20 * n).astype(np.int16)),
             pa.array(rng.integers(1, 10, 20 * n).astype(np.int16)), pa.array(np.full(20 * n, 8, np.int32)),
             pa.array(acc.ravel()), pa.array(np.ones(20 * n, np.float32)), pa.array(np.ones(20 * n, np.float32))],
            fields=list(SCHEMA.field("rounds").type.value_type)))
    failed = rng.random(n) < 0.01
    cols = {
        "prompt_id": [f"id{i:06d}" for i in range(n)], "prompt": [f"prompt {i}" for i in range(n)],
        "status": np.where(failed, "failed", "ok").tolist(), "error": [("boom" if f else None) for f in failed],
        "image_key": [f"images/id{i:06d}.png" for i in range(n)], "method": ["adt"] * n, "grid_h": [h] * n,
        "grid_w": [w] * n, "actor_id": [f"actor{i % 8}" for i in range(n)],
        "finished_at": [t0 + dt.timedelta(milliseconds=37 * i) for i in range(n)],
        "generation_time_ms": rng.gamma(4, 50, n), "speedup": np.where(rng.random(n) < 0.05, rng.normal(1.3, 0.2, n), np.nan),
        "estimated_speedup": rng.normal(1.4, 0.2, n), "mean_acceptance_length": 1 + acc.mean(axis=1),
        "num_spec_steps": [20] * n, "accepted_lengths": pa.array(list(acc), pa.list_(pa.int16())), "rounds": rounds,
    }
    arrays = []
    for f in SCHEMA:
        v = cols.get(f.name)
        arrays.append(pa.nulls(n, f.type) if v is None else (v if isinstance(v, pa.Array) else pa.array(v, f.type, from_pandas=True)))
    return pa.Table.from_arrays(arrays, schema=SCHEMA)


def test_report_100k_rows_loads_only_the_images_it_shows(tmp_path, monkeypatch):
    root = tmp_path / "big"
    (root / "telemetry").mkdir(parents=True)
    pq.write_table(_synthetic(100_000), root / "telemetry" / "run-x_c0_000.parquet", row_group_size=20_000)
    fetched: list[str] = []
    real_get = LocalStorage.get_bytes

    def spy(self, key):
        fetched.append(key)
        return real_get(self, key)

    monkeypatch.setattr(LocalStorage, "get_bytes", spy)
    rep = make_report(str(root), tmp_path / "rep", max_map_rows=3000, samples=6)
    images = [k for k in fetched if k.startswith("images/")]
    assert 0 < len(images) <= 6 + 3  # the sample grid and the single-image maps, nothing else
    md = rep.markdown_path.read_text()
    assert "Prompts: 100,000" in md and " | boom |" in md
    assert "over 3,000 images" in md
    assert len(rep.charts) == len(CHARTS) and all(len(c.png) > 2000 for c in rep.charts)
