"""A pool's actors end with it, however its job ends (pipeline.pool_actors), so the next job
in the same Ray session gets their CPUs. An interrupt landing inside Ray Data's teardown of
the pool (a lost lease's SIGINT while the pool stops on a storage error: the store's outage
fails the ledger write and the lease renewal within the same retry budget) left the actor
alive, and the next job's pool waited for it (a resume hung in test_job_faults)."""

import contextlib
import io
import signal
import threading

import pytest

from pipeline import progress_sink
from pipeline.config import build_config
from pipeline.driver import _Signals, run_job
from pipeline.execute import JobInterrupted
from pipeline.exit_codes import EXIT_INTERRUPTED, EXIT_OK
from pipeline.retry import StorageUnavailable
from pipeline_helpers import live_pool_actors, simple_rows, write_prompts


def job(tmp_path, src, **over):
    data = {"job_id": "t", "bundle": "random:0", "input": str(src), "output": str(tmp_path / "out"),
            "num_actors": 1, "batch_size": 2, "decode": {"method": "ar", "temperature": 0.0}, "progress": False}
    data.update(over)
    return build_config(data)


def test_a_signal_while_held_is_raised_when_the_block_ends():
    signals = _Signals()
    signals.install()
    try:
        reached_end = False
        with pytest.raises(JobInterrupted, match="SIGINT"):
            with signals.held():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                for _ in range(1000):  # the handler runs here (between bytecodes) and must not raise
                    pass
                reached_end = True
        assert reached_end
    finally:
        signals.restore()


@pytest.mark.parametrize("held", [True, False], ids=["signals-held", "actors-killed-after"])
def test_an_interrupt_inside_the_pool_teardown_leaves_no_actor_alive(tmp_path, ray_session, monkeypatch, held):
    """The store fails the first ledger write; while Ray Data shuts the pool down (its executor
    thread's join, after it marked itself shut down and before it kills the actors) SIGINT
    arrives, as a lost lease sends it. Both guards are checked: signals held over the teardown,
    and without that hold the pool's leftover actors killed after it. 16 prompts: the pool is
    far from done at the first chunk, so the driver's call is the one that shuts it down (a
    pool that had finished is shut down by Ray Data's iterator thread first, which only drops
    the actors' handles)."""
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    if not held:
        monkeypatch.setattr(_Signals, "held", lambda self: contextlib.nullcontext())
    src = write_prompts(tmp_path / "p.parquet", simple_rows(16))
    failed, fired = [], []

    def put(self, table, _put=progress_sink.RowSink.put):
        if not failed:
            failed.append(True)
            raise StorageUnavailable("s3://bucket/out", "write failed (simulated outage)")
        return _put(self, table)

    def join(self, timeout=None, _join=StreamingExecutor.join):
        if failed and not fired and threading.current_thread() is threading.main_thread():
            fired.append(True)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # driver._Signals.interrupt
        return _join(self, timeout)

    monkeypatch.setattr(progress_sink.RowSink, "put", put)
    monkeypatch.setattr(StreamingExecutor, "join", join)
    before = live_pool_actors()
    res = run_job(job(tmp_path, src), stream=io.StringIO())
    assert fired, "Ray Data's shutdown no longer joins its thread from the caller: move the interrupt"
    assert res.exit_code == EXIT_INTERRUPTED
    assert not live_pool_actors() - before  # no actor of the stopped pool left holding CPUs
    if held:  # the next job in this Ray gets them (the other way is the same state)
        again = run_job(job(tmp_path, src, resume=True), stream=io.StringIO())
        assert again.exit_code == EXIT_OK and again.summary["job_ok"] == 16
