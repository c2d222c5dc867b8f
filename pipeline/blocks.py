"""Block sizes per operator: the generation stage's chunks handed on at once, the prompt read
in ordinary blocks, in one streaming plan.

A worker yields a chunk of rows as its images finish; Ray Data holds yielded rows until a
block reaches `DataContext.target_max_block_size` (128 MiB), so the driver would see them
only when the call ends. Under a 1-byte target each yield is a block of its own. That
target is the dataset's context, shared by every operator of the plan, and the prompt read
under it would be cut into one-row blocks; the pipeline used to materialize the prompts
first (the whole selected set in the object store before any actor starts) to keep the read
out of it.

Ray Data's physical operators take a per-operator override
(`override_target_max_block_size`), which `InheritTargetMaxBlockSizeRule` propagates up the
plan to every operator above that has none. `StreamChunksRule`, a physical-plan rule run
after that one and before fusion, gives the map operator of a registered worker class a
1-byte override and takes the inherited 1 byte back off every operator above it (an override
of None: the context's 128 MiB; a streaming repartition refuses any other override). The
read, the filter and the repartition keep ordinary blocks, and nothing has to be
materialized. (Ray Data never fuses a repartition into the map below it.)

This uses Ray Data's DeveloperAPI ruleset (`get_physical_ruleset`) and two internals (a
physical operator's `_logical_operators`, its `override_target_max_block_size`), pinned by
pyproject's `ray>=2.60,<2.61`; tests/pipeline/test_progress.py (rows come back while a call
runs) fails if the override stops taking effect.
"""

from __future__ import annotations

import threading

STREAM_BLOCK_BYTES = 1  # the generation stage: every yielded chunk is a block of its own
_STREAMED: set[str] = set()  # worker class names whose map operator streams its chunks
_lock = threading.Lock()
_installed = False


def stream_chunks(worker: type) -> None:
    """Give the map operator of `worker` (an actor class passed to map_batches) a 1-byte
    block target in every plan this process runs from now on."""
    global _installed
    with _lock:
        _STREAMED.add(worker.__name__)
        if not _installed:
            from ray.data._internal.logical.optimizers import get_physical_ruleset

            get_physical_ruleset().add(_rule_class())
            _installed = True


def _is_streamed(op) -> bool:
    for logical in getattr(op, "_logical_operators", None) or []:
        fn = getattr(logical, "fn", None)
        if isinstance(fn, type) and fn.__name__ in _STREAMED:
            return True
    return False


def _walk(op, seen=None):
    seen = set() if seen is None else seen
    if id(op) in seen:
        return
    seen.add(id(op))
    yield op
    for up in op.input_dependencies:
        yield from _walk(up, seen)


def _rule_class():
    from ray.data._internal.logical.interfaces import Rule
    from ray.data._internal.logical.rules import FuseOperators, InheritTargetMaxBlockSizeRule

    class StreamChunksRule(Rule):
        """The registered workers' map operators at STREAM_BLOCK_BYTES; the 1 byte that
        InheritTargetMaxBlockSizeRule copied up from them taken back off every operator above
        (they keep the context's target). Before fusion, so the two never fuse."""

        @classmethod
        def dependencies(cls):
            return [InheritTargetMaxBlockSizeRule]

        @classmethod
        def dependents(cls):
            return [FuseOperators]

        def apply(self, plan):
            for op in list(_walk(plan.dag)):
                if not _is_streamed(op):
                    continue
                op.override_target_max_block_size(STREAM_BLOCK_BYTES)
                for up in list(_walk(op))[1:]:
                    if not _is_streamed(up) and up.target_max_block_size_override == STREAM_BLOCK_BYTES:
                        up.override_target_max_block_size(None)  # inherited from the worker's: back to the context's
            return plan

    return StreamChunksRule
