"""The telemetry ledger (items 5, 13) and the output lease (item 9), without Ray."""

import datetime as dt
import json
import os
import threading

import numpy as np
import pyarrow as pa
import pytest

from pipeline.config import StorageSettings
from pipeline.lease import LEASE_KEY, Lease, LeaseHeld, LeaseInfo
from pipeline.ledger import Ledger, compact, done_ids, latest_per_prompt, read_telemetry
from pipeline.storage import open_storage
from pipeline.telemetry import RowContext, failed_row, to_table

CTX = RowContext(job_id="j", bundle="b", method="ar", config_hash="h")


def rows(ids, status="ok"):
    return to_table([failed_row(CTX, i, 0, "x") | ({"status": "ok", "error": None} if status == "ok" else {}) for i in ids])


def test_every_batch_is_durable_at_once_then_compacted(tmp_path):
    out = open_storage(str(tmp_path / "out"))
    ledger = Ledger(out, "run-a", flush_rows=1)
    ledger.add(rows(["a", "b"]))
    assert done_ids(out) == {"a", "b"}  # durable before the next batch arrives
    ledger.add(rows(["c"], status="failed"))
    ledger.add(rows(["d"]))
    assert ledger.rows_written == 4 and len(out.list_keys("telemetry")) == 3
    assert compact(out, rows_per_file=3) == 3
    keys = out.list_keys("telemetry")
    assert len(keys) == 2 and all("-part-" not in k for k in keys)  # 4 rows in files of <= 3
    assert sorted(read_telemetry(out)["prompt_id"].to_pylist()) == ["a", "b", "c", "d"]
    assert done_ids(out) == {"a", "b", "d"} and compact(out) == 0


def test_flush_rows_batches_small_writes(tmp_path):
    out = open_storage(str(tmp_path / "out"))
    ledger = Ledger(out, "run-b", flush_rows=3)
    ledger.add(rows(["a", "b"]))
    assert out.list_keys("telemetry") == []
    ledger.add(rows(["c"]))
    assert len(out.list_keys("telemetry")) == 1
    ledger.add(rows(["d"]))
    ledger.flush()
    assert ledger.rows_written == 4 and ledger.rows_received == 4


def test_compaction_after_a_crash_between_write_and_delete(tmp_path):
    out = open_storage(str(tmp_path / "out"))
    ledger = Ledger(out, "run-c")
    for i in ids_in(3):
        ledger.add(rows([i]))
    compact(out)
    merged = out.list_keys("telemetry")
    Ledger(out, "run-c").add(rows(["late"]))  # a part the crashed run left behind
    compact(out)
    assert set(merged) < set(out.list_keys("telemetry"))  # earlier merged file untouched
    assert sorted(read_telemetry(out)["prompt_id"].to_pylist()) == ["late", "p0", "p1", "p2"]


def ids_in(n):
    return [f"p{i}" for i in range(n)]


def _reference_latest(table):
    ok = [s == "ok" for s in table["status"].to_pylist()]
    ts = table["finished_at"].cast(pa.int64()).fill_null(0).to_pylist()
    best = {}
    for i in sorted(range(table.num_rows), key=lambda i: (ok[i], ts[i])):
        best[table["prompt_id"][i].as_py()] = i
    return sorted(best.values())


def test_latest_per_prompt_matches_the_definition_on_many_rows():
    rng = np.random.default_rng(0)
    n = 50_000
    t0 = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    table = pa.table({
        "prompt_id": pa.array([f"id{i}" for i in rng.integers(0, 8_000, n)]),
        "status": pa.array(np.where(rng.random(n) < 0.4, "ok", "failed")),
        "finished_at": pa.array([t0 + dt.timedelta(seconds=int(s)) for s in rng.integers(0, 50, n)],
                                pa.timestamp("ms", tz="UTC")),
        "row": pa.array(np.arange(n)),
    })
    got = latest_per_prompt(table)["row"].to_pylist()
    assert got == _reference_latest(table)
    assert len(set(latest_per_prompt(table)["prompt_id"].to_pylist())) == got.__len__()


# ---- item 9: one writer per output


def _stores(tmp_path, s3=None):
    yield open_storage(str(tmp_path / "out"))
    if s3 is not None:
        yield open_storage(f"s3://{s3.bucket}/out", StorageSettings(endpoint_url=s3.endpoint, retry_budget_s=2))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_two_jobs_at_once_exactly_one_gets_the_lease(tmp_path, s3, kind):
    store = list(_stores(tmp_path, s3))[0 if kind == "local" else 1]
    start = threading.Barrier(4)
    won, held = [], []

    def contend(i):
        lease = Lease(store, f"job{i}/run", ttl_s=60)
        start.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseHeld as e:
            held.append(e.holder.owner)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(held) == 3 and set(held) == {won[0].owner}
    info = LeaseInfo.parse(store.get_bytes(LEASE_KEY))
    assert info.owner == won[0].owner and info.pid == os.getpid() and info.expires_at > info.acquired_at
    won[0].release()
    assert not store.exists(LEASE_KEY)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_expired_or_orphaned_lease_is_taken_over(tmp_path, s3, kind):
    store = list(_stores(tmp_path, s3))[0 if kind == "local" else 1]
    clock = [1000.0]
    old = Lease(store, "old/run", ttl_s=60, clock=lambda: clock[0])
    old.acquire()
    old._stop.set()  # the old job stops renewing (crashed)
    with pytest.raises(LeaseHeld, match="in use by job old/run"):
        Lease(store, "new/run", ttl_s=60, clock=lambda: clock[0]).acquire()
    clock[0] += 61
    new = Lease(store, "new/run", ttl_s=60, clock=lambda: clock[0])
    new.acquire()
    assert LeaseInfo.parse(store.get_bytes(LEASE_KEY)).owner == "new/run"
    assert not old.renew() and old.lost  # the old holder cannot write over it any more
    new.release()
    # a lease whose process is gone on this host is stale at once
    dead = LeaseInfo("dead/run", os.uname().nodename, 2**22 + 12345, 0.0, 1e12)
    store.put_bytes(LEASE_KEY, dead.to_bytes())
    again = Lease(store, "next/run", ttl_s=60)
    again.acquire()
    assert json.loads(store.get_bytes(LEASE_KEY))["owner"] == "next/run"
    again.release()
