"""Ray Data's own checkpointing (Ray 2.60: `DataContext.checkpoint_config = CheckpointConfig(...)`)
tried on real Parquet with the session's local Ray, no fakes: each claim docs/pipeline.md
("What each layer guarantees") makes about Ray's layer has its test here; the claims about the
pipeline's own ledger name their tests in the doc.

A plan shaped like a small version of ours: read prompts -> map_batches (the stand-in worker:
an image per prompt written inside the task, then a row per prompt with a status) ->
write_parquet. Every image write also leaves a marker file with a fresh name, so a test counts
how often each prompt was generated. No wall time is asserted."""

from __future__ import annotations

import os
import sys
import time
import uuid
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import ray.cloudpickle

# Ray's workers cannot import this file (tests/ is not a package on their path): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

N_FILES, PER_FILE = 3, 40
PENDING = ".pending.parquet"  # Ray's suffix of a checkpoint not yet committed (checkpoint_writer.py)


def _prompts(root: Path) -> tuple[str, list[str]]:
    """N_FILES Parquet files of PER_FILE prompts each: one read task (one block) per file."""
    src = root / "prompts"
    src.mkdir(parents=True)
    ids = [f"p{i:04d}" for i in range(N_FILES * PER_FILE)]
    for f in range(N_FILES):
        part = ids[f * PER_FILE:(f + 1) * PER_FILE]
        pq.write_table(pa.table({"prompt_id": part, "prompt": [f"a face {i}" for i in part]}), src / f"{f}.parquet")
    return str(src), ids


@contextmanager
def _checkpointing(ckpt: Path, **kw):
    """The session's DataContext with a CheckpointConfig at `ckpt` (kept on success unless
    told otherwise) and the v1 Parquet read our pipeline uses (a read task per file; the v2
    read puts these small files in one task), restored after."""
    from ray.data import DataContext
    from ray.data.checkpoint import CheckpointConfig

    ctx = DataContext.get_current()
    saved = ctx.checkpoint_config, ctx.use_datasource_v2
    ctx.checkpoint_config = CheckpointConfig(id_column="prompt_id", checkpoint_path=str(ckpt),
                                             **({"delete_checkpoint_on_success": False} | kw))
    ctx.use_datasource_v2 = False
    try:
        yield
    finally:
        ctx.checkpoint_config, ctx.use_datasource_v2 = saved


def _write(root: Path, **fn_kwargs) -> None:
    """read -> _generate -> write_parquet(root/out), checkpointed at root/ckpt; a
    `checkpoint_manager_cls` or `delete_checkpoint_on_success` goes to the config."""
    import ray

    cfg = {k: fn_kwargs.pop(k) for k in ("checkpoint_manager_cls", "delete_checkpoint_on_success") if k in fn_kwargs}
    with _checkpointing(root / "ckpt", **cfg):
        ds = ray.data.read_parquet(str(root / "prompts"), override_num_blocks=N_FILES)
        ds = ds.map_batches(_generate, fn_kwargs={"root": str(root)} | fn_kwargs, batch_format="pyarrow",
                            batch_size=None)
        ds.write_parquet(str(root / "out"))


def _generate(batch: pa.Table, root: str, fail_on: str = "", failed_ids: tuple = ()) -> pa.Table:
    """The stand-in worker: images/<id>.png (an idempotent key) and a marker per write, then
    the rows (status failed for `failed_ids`). At `fail_on`, while root/second-run is absent,
    it waits until another block's checkpoint is committed, then raises (an engine crash
    after the images of the rows before it)."""
    rows = []
    for pid in batch["prompt_id"].to_pylist():
        if pid == fail_on and not os.path.exists(os.path.join(root, "second-run")):
            _wait_for_a_commit(Path(root, "ckpt"))
            raise RuntimeError(f"engine crash at {pid}")
        Path(root, "images", f"{pid}.png").write_bytes(b"png")
        Path(root, "writes", f"{pid}.{uuid.uuid4().hex}").write_bytes(b"")
        rows.append(pid)
    status = ["failed" if p in failed_ids else "ok" for p in rows]
    return pa.table({"prompt_id": rows, "status": status})


def _wait_for_a_commit(ckpt: Path, limit_s: float = 30) -> None:
    """Until `ckpt` holds a committed checkpoint file (or `limit_s` passed: the test's own
    assertion then fails)."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end and not _committed_files(ckpt):
        time.sleep(0.05)


def _committed_files(ckpt: Path) -> list[Path]:
    return [p for p in ckpt.glob("*.parquet") if not p.name.endswith(PENDING)] if ckpt.exists() else []


def _setup(tmp_path: Path) -> list[str]:
    _, ids = _prompts(tmp_path)
    for d in ("images", "writes"):
        (tmp_path / d).mkdir()
    return ids


def _generated(root: Path) -> Counter:
    """How many times each prompt was generated (its image written)."""
    return Counter(p.name.split(".")[0] for p in (root / "writes").iterdir())


def _out(root: Path) -> pa.Table:
    return pq.read_table(root / "out", columns=["prompt_id", "status"])


def test_a_failed_job_rerun_commits_every_row_once_redoing_only_uncommitted_blocks(tmp_path, ray_session):
    """The two-phase commit of a file datasink: after a job that failed mid-way and its rerun,
    the output holds every row exactly once; blocks whose checkpoint was committed are not
    generated again. The images written inside the task are outside Ray's guarantee: those of
    the failed block's rows before the crash were written twice (same key, one image each)."""
    ids = _setup(tmp_path)
    bad = ids[2 * PER_FILE + PER_FILE // 2]  # the middle of the last file's block
    with pytest.raises(Exception, match="engine crash"):
        _write(tmp_path, fail_on=bad)
    committed = set(pq.read_table(_committed_files(tmp_path / "ckpt"))["prompt_id"].to_pylist())
    assert committed and bad not in committed
    (tmp_path / "second-run").write_text("")
    _write(tmp_path, fail_on=bad)
    got = _out(tmp_path)["prompt_id"].to_pylist()
    assert sorted(got) == ids  # every prompt's row exactly once
    assert sorted(p.stem for p in (tmp_path / "images").iterdir()) == ids  # one image per key
    gen = _generated(tmp_path)
    assert all(gen[p] == 1 for p in committed)  # committed blocks: not redone
    assert all(gen[p] >= 2 for p in ids[2 * PER_FILE:2 * PER_FILE + PER_FILE // 2])  # at least once


def test_a_data_file_whose_checkpoint_is_still_pending_is_deleted_and_its_rows_redone(tmp_path, ray_session):
    """The second phase: a task that wrote its data file but died before renaming its pending
    checkpoint leaves `<file>.pending.parquet` (made here from a finished job's committed
    checkpoint, the state such a crash leaves). The next run deletes that data file and
    writes its rows again: still exactly once in the output."""
    ids = _setup(tmp_path)
    _write(tmp_path)
    ckpt = sorted(_committed_files(tmp_path / "ckpt"))[0]
    undone = pq.read_table(ckpt)["prompt_id"].to_pylist()
    base = ckpt.name[:-len(".parquet")]
    assert [p for p in (tmp_path / "out").iterdir() if p.name.startswith(base)]  # its data file
    ckpt.rename(ckpt.with_name(base + PENDING))
    _write(tmp_path)
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(base)]  # deleted
    assert sorted(_out(tmp_path)["prompt_id"].to_pylist()) == ids
    gen = _generated(tmp_path)
    assert sorted(p for p in ids if gen[p] == 2) == sorted(undone) and all(gen[p] == 1 for p in set(ids) - set(undone))


def test_failed_rows_are_checkpointed_as_done_and_not_retried(tmp_path, ray_session):
    """The checkpoint records the id of every row written, whatever its status (ids only):
    a rerun generates none of them again, failed rows included (our resume retries them)."""
    ids = _setup(tmp_path)
    failed = tuple(ids[::7])
    _write(tmp_path, failed_ids=failed)
    ckpt = pq.read_table(_committed_files(tmp_path / "ckpt"))
    assert ckpt.column_names == ["prompt_id"] and sorted(ckpt["prompt_id"].to_pylist()) == ids
    _write(tmp_path)
    assert set(_generated(tmp_path).values()) == {1}  # nothing generated again
    out = _out(tmp_path)
    assert sorted(out.filter(pc.equal(out["status"], "failed"))["prompt_id"].to_pylist()) == sorted(failed)


def _ok_rows_manager():
    """A CheckpointManager (Ray 2.60's `checkpoint_manager_cls`) whose done ids are the ok rows
    of the job's output (root/out) instead of the checkpoint's ids: failed rows are retried."""
    from ray.data.checkpoint import CheckpointManager

    class OkRows(CheckpointManager):
        def load_checkpoint(self, data_file_dir=None, data_file_filesystem=None):
            import ray

            self._clean_pending_checkpoints(data_file_dir, data_file_filesystem)
            out = pq.read_table(Path(self.checkpoint_path).parent / "out", columns=["prompt_id", "status"])
            ok = np.sort(np.array(out.filter(pc.equal(out["status"], "ok"))["prompt_id"].to_pylist(), dtype=object))
            return (ray.put(ok), int(ok.nbytes)) if len(ok) else (None, 0)  # the size: the filter's memory ask

    return OkRows


def test_a_custom_manager_can_retry_failed_rows_but_the_output_then_holds_two_rows_for_them(tmp_path, ray_session):
    """With a manager that counts only ok rows as done, a rerun generates the failed prompts
    again, and appends their new rows beside the failed ones: the output is no longer one row
    per prompt; a reader must take each prompt's latest row (what our ledger's reader does)."""
    ids = _setup(tmp_path)
    failed = tuple(ids[::7])
    _write(tmp_path, failed_ids=failed)
    _write(tmp_path, checkpoint_manager_cls=_ok_rows_manager())
    gen = _generated(tmp_path)
    assert sorted(p for p in ids if gen[p] == 2) == sorted(failed)  # the failed ones, retried
    out = _out(tmp_path)
    assert out.num_rows == len(ids) + len(failed)
    twice = [p for p, c in Counter(out["prompt_id"].to_pylist()).items() if c == 2]
    assert sorted(twice) == sorted(failed)


def test_by_default_the_checkpoint_is_deleted_on_success_and_a_rerun_redoes_everything(tmp_path, ray_session):
    """`delete_checkpoint_on_success=True` (the default): Ray's checkpoint only recovers a job
    that failed; after a finished one a rerun generates every prompt again and the output
    holds every row twice (our --resume reads the ledger, which a finished job keeps)."""
    ids = _setup(tmp_path)
    _write(tmp_path, delete_checkpoint_on_success=True)
    assert not (tmp_path / "ckpt").exists()
    _write(tmp_path, delete_checkpoint_on_success=True)
    assert set(_generated(tmp_path).values()) == {2}
    assert sorted(_out(tmp_path)["prompt_id"].to_pylist()) == sorted(ids * 2)


def test_a_plan_that_hands_rows_to_the_driver_gets_no_checkpointing(tmp_path, ray_session):
    """Ray 2.60 checkpoints only plans that start at a read and end in a write (or a
    streaming split): ours ends in iter_batches (the rows go to the driver's sink and ledger),
    so Ray turns checkpointing off with a warning and writes no checkpoint."""
    import ray

    ids = _setup(tmp_path)
    with _checkpointing(tmp_path / "ckpt"):
        ds = ray.data.read_parquet(str(tmp_path / "prompts"))
        ds = ds.map_batches(_generate, fn_kwargs={"root": str(tmp_path)}, batch_format="pyarrow", batch_size=None)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            rows = sum(b.num_rows for b in ds.iter_batches(batch_size=None, batch_format="pyarrow"))
    assert rows == len(ids)
    assert any("doesn't support checkpointing" in str(w.message) for w in said)
    assert not _committed_files(tmp_path / "ckpt")
