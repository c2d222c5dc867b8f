"""The worker as plain Python (no Ray): real random bundle, real engine, real files."""

import io

import pyarrow as pa
import pytest
from PIL import Image

from pipeline.config import build_config
from pipeline.telemetry import SCHEMA
from pipeline.worker import GeneratorWorker, WorkerDied, in_baseline_sample

SMALL_TREE = {"depth": 3, "top_k": 2, "budget": 6}


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: one intra-op thread is many times faster than two under load."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_worker(tmp_path, **over):
    data = {"job_id": "wtest", "bundle": "random:0", "output": str(tmp_path / "out"), "device": "cpu",
            "max_prompt_chars": 200, "decode": {"method": "eagle2", "temperature": 0.0, "tree": SMALL_TREE}}
    for k, v in over.items():
        data[k] = v
    return GeneratorWorker(build_config(data).model_dump(mode="json"))


def batch(rows):
    return pa.Table.from_pylist(rows)


def test_batch_with_good_and_bad_rows(tmp_path):
    w = make_worker(tmp_path)
    rows = [
        {"prompt_id": "good/1", "prompt": "a red cat", "seed": 1},
        {"prompt_id": "null", "prompt": None, "seed": 2},
        {"prompt_id": "empty", "prompt": "", "seed": 3},
        {"prompt_id": "huge", "prompt": "x" * 10_000, "seed": 4},
        {"prompt_id": "negseed", "prompt": "a dog", "seed": -5},
        {"prompt_id": "good2", "prompt": "a blue dog", "seed": None},
    ]
    out = w.run(batch(rows))
    assert out.schema.equals(SCHEMA) and out.num_rows == len(rows)
    got = {r["prompt_id"]: r for r in out.to_pylist()}
    assert [got[i]["status"] for i in ("good/1", "good2")] == ["ok", "ok"]
    assert got["null"]["error"] == "invalid prompt: null" and got["empty"]["error"] == "invalid prompt: empty"
    assert got["huge"]["error"].startswith("invalid prompt: 10000 characters")
    assert got["negseed"]["error"].startswith("invalid seed: -5") and got["negseed"]["seed"] == -5
    assert all(got[i]["status"] == "failed" and got[i]["image_key"] is None for i in ("null", "empty", "huge", "negseed"))
    ok = got["good/1"]
    assert ok["image_key"].startswith("images/good_1-") and ok["image_key"].endswith(".png")
    assert len(ok["tokens"]) == ok["grid_h"] * ok["grid_w"] == 64
    assert ok["method"] == "eagle2" and ok["num_draft_tokens"] > 0 and ok["rounds"] and ok["generation_time_ms"] > 0
    assert got["good2"]["seed"] is not None  # derived from the prompt id
    png = (tmp_path / "out" / ok["image_key"]).read_bytes()
    assert Image.open(io.BytesIO(png)).size == (16, 16)
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == sorted(
        r["image_key"].split("/")[1] for r in got.values() if r["status"] == "ok")


def test_deterministic_and_greedy_matches_ar_baseline(tmp_path):
    w = make_worker(tmp_path, baseline_fraction=1.0)
    rows = [{"prompt_id": f"p{i}", "prompt": f"smiling face {i}", "seed": i} for i in range(2)]
    a = w.run(batch(rows)).to_pylist()
    b = w.run(batch(rows)).to_pylist()
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    for r in a:  # exact speculative decoding: greedy tree decoding == greedy vanilla AR
        assert r["baseline_tokens_match"] is True and r["speedup"] > 0 and r["baseline_time_ms"] > 0


def test_one_bad_prompt_fails_alone(tmp_path, monkeypatch):
    """The engine raises mid-stream (after one image): the rest are retried alone."""
    w = make_worker(tmp_path, decode={"method": "ar", "temperature": 0.0})
    real_generate, real_rounds = w.generator.generate, w.generator.rounds

    def flaky(prompts, seeds):
        if any("boom" in p for p in prompts):
            raise RuntimeError("engine exploded on boom")
        return real_generate(prompts, seeds)

    def flaky_rounds(prompts, seeds):
        n = 0
        for finished in real_rounds(prompts, seeds):
            for item in finished:
                if n == 1 and any("boom" in p for p in prompts):
                    raise RuntimeError("engine exploded on boom")
                n += 1
                yield [item]

    monkeypatch.setattr(w.generator, "generate", flaky)
    monkeypatch.setattr(w.generator, "rounds", flaky_rounds)
    rows = [{"prompt_id": f"p{i}", "prompt": p, "seed": i} for i, p in enumerate(["a cat", "boom", "a dog"])]
    got = {r["prompt_id"]: r for r in w.run(batch(rows)).to_pylist()}
    assert (got["p0"]["status"], got["p1"]["status"], got["p2"]["status"]) == ("ok", "failed", "ok")
    assert got["p1"]["error"] == "RuntimeError: engine exploded on boom"


def test_prompt_the_engine_refuses_fails_alone_while_others_stay_in_flight(tmp_path, monkeypatch):
    w = make_worker(tmp_path, decode={"method": "eagle2", "temperature": 0.0, "batch_size": 4})
    enc = w.bundle.text_encoder
    real = enc.encode

    def encode(prompts):
        if any("boom" in p for p in prompts):
            raise ValueError("caption cannot be encoded")
        return real(prompts)

    monkeypatch.setattr(enc, "encode", encode)
    texts = ["a cat", "boom", "a dog", "a red heart", "a tree"]
    rows = [{"prompt_id": f"p{i}", "prompt": p, "seed": i} for i, p in enumerate(texts)]
    got = {r["prompt_id"]: r for r in w.run(batch(rows)).to_pylist()}
    assert [got[f"p{i}"]["status"] for i in range(5)] == ["ok", "failed", "ok", "ok", "ok"]
    assert got["p1"]["error"] == "ValueError: caption cannot be encoded"


def test_storage_error_fails_the_row(tmp_path, monkeypatch):
    w = make_worker(tmp_path, decode={"method": "ar", "temperature": 0.0})
    real = w.storage.put_bytes

    def put(key, data, content_type=None):
        if "p1" in key:
            raise OSError("disk full")
        return real(key, data, content_type)

    monkeypatch.setattr(w.storage, "put_bytes", put)
    rows = [{"prompt_id": f"p{i}", "prompt": "a cat", "seed": i} for i in range(2)]
    got = {r["prompt_id"]: r for r in w.run(batch(rows)).to_pylist()}
    assert got["p0"]["status"] == "ok" and got["p1"]["error"] == "OSError: disk full"
    assert not (tmp_path / "out" / "images" / "p1.png").exists()


def test_unrecoverable_error_outside_ray_raises(tmp_path, monkeypatch):
    w = make_worker(tmp_path, decode={"method": "ar", "temperature": 0.0})

    def oom(prompts, seeds):
        raise MemoryError("out of memory")

    monkeypatch.setattr(w.generator, "generate", oom)
    monkeypatch.setattr(w.generator, "rounds", oom)
    with pytest.raises(WorkerDied):
        w.run(batch([{"prompt_id": "p", "prompt": "a cat", "seed": 1}]))


def test_baseline_sample_is_deterministic_fraction():
    ids = [f"id{i}" for i in range(2000)]
    picked = [i for i in ids if in_baseline_sample(i, 0.1)]
    assert 140 < len(picked) < 260 and picked == [i for i in ids if in_baseline_sample(i, 0.1)]
    assert not any(in_baseline_sample(i, 0.0) for i in ids) and all(in_baseline_sample(i, 1.0) for i in ids)


class TickTimer:
    """A synthetic engine clock: every reading is 1 ms after the last, so a round costs the
    same however many images are in it (a device whose forward is flat in batch size, where
    an AR baseline at a lower occupancy would look slower per image)."""

    def __init__(self, device):
        self.t = 0.0

    def now(self) -> float:
        self.t += 1.0
        return self.t

    mark = now


@pytest.mark.parametrize("in_flight", [4, 16, 64])
def test_measured_speedup_is_ar_at_the_same_occupancy(tmp_path, monkeypatch, in_flight):
    """AR against itself with a quarter of the prompts measured: the baseline runs at the
    batch's occupancy (filled with other prompts of the call), so the measured speedup is 1x,
    not images in flight / measured prompts."""
    import adt_core.engine

    monkeypatch.setattr(adt_core.engine, "Timer", TickTimer)
    w = make_worker(tmp_path, baseline_fraction=0.25, decode={"method": "ar", "temperature": 0.0, "batch_size": in_flight, "max_tokens": 8})
    n = max(16, in_flight)
    out = w.run(batch([{"prompt_id": f"q{i}", "prompt": f"face {i}", "seed": i} for i in range(n)])).to_pylist()
    measured = [r for r in out if r["baseline_time_ms"] is not None]
    assert 0 < len(measured) < n and all(r["status"] == "ok" for r in out)
    assert all(r["baseline_in_flight"] == r["in_flight"] == min(in_flight, n) for r in measured)
    speedups = sorted(r["speedup"] for r in measured)
    assert 0.9 <= speedups[len(speedups) // 2] <= 1.1, speedups
    assert all(r["baseline_tokens_match"] for r in measured)
