"""Images are encoded and stored off the decode path (pipeline.writer): a store slowed to
200 ms per PUT (the loopback S3 server behind the TCP proxy) barely slows decoding, every
image is durable before its row, and back-pressure bounds what is held."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from pipeline.config import StorageSettings, build_config
from pipeline.storage import open_storage
from pipeline.worker import GeneratorWorker
from pipeline.writer import ImageWriter


@pytest.fixture(autouse=True)
def one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompts(tag: str, n: int) -> pa.Table:
    return pa.Table.from_pylist([{"prompt_id": f"{tag}{i}", "prompt": f"face {i}", "seed": i} for i in range(n)])


def test_slow_store_does_not_stall_decoding(s3, proxy):
    """With 200 ms per PUT, decoding images/s is at least 0.9x what it is on the direct store.
    Measured robustly on this shared machine: decoding images/s = images / (the decode loop's
    own busy time + the time it was blocked on the writer pool); busy time is the same work in
    both runs, so the ratio is busy / (busy + blocked) of the slow run (the direct store blocks
    nothing: checked). The wall-clock rates of the two runs are printed beside it. A writer
    pool of one (a PUT on the decode path) is the control: the same measure sees its stall."""
    cfg = {"job_id": "slow", "bundle": "random:0", "output": f"s3://{s3.bucket}/fast", "device": "cpu",
           "storage": {"endpoint_url": s3.endpoint}, "decode": {"method": "ar", "temperature": 0.0, "batch_size": 8}}
    w = GeneratorWorker(build_config(cfg).model_dump(mode="json"))
    fast = w.storage
    slow = open_storage(f"s3://{s3.bucket}/slow", StorageSettings(endpoint_url=proxy.endpoint))
    proxy.put_delay_s = 0.2

    def decode(store, tag: str, n: int) -> float:
        w.storage = store
        rows = w.run(_prompts(tag, n)).to_pylist()
        assert [r["status"] for r in rows] == ["ok"] * n
        assert {r["image_key"] for r in rows} <= set(store.list_keys("images"))  # durable before the rows left
        busy = w.decode_s - w.write_wait_s
        print(f"{tag}: {n / w.decode_s:.2f} images/s over {w.decode_s:.2f} s, blocked on writes {w.write_wait_s:.3f} s")
        return busy / (busy + w.write_wait_s)

    assert decode(fast, "fast", 16) > 0.99
    assert decode(slow, "slow", 16) >= 0.9
    w.writer.close()
    w.writer = ImageWriter(w._row, max_pending=1, threads=1)  # the control: every PUT waited for in turn
    assert decode(slow, "serial", 6) < 0.9


def test_back_pressure_bounds_the_writes_held():
    gate, started, held = threading.Event(), [], []

    def write(i):
        started.append(i)
        gate.wait()
        return i

    writer = ImageWriter(write, max_pending=3, threads=2)
    got = []
    for i in range(3):
        got += writer.submit(i)
    blocker = threading.Thread(target=lambda: held.append(writer.submit(3)))
    blocker.start()
    blocker.join(0.2)
    assert blocker.is_alive() and len(writer.pending) == 3  # the 4th waits for the oldest
    gate.set()
    blocker.join()
    assert got + held[0] + list(writer.drain()) == [0, 1, 2, 3]  # submission order
    writer.close()
