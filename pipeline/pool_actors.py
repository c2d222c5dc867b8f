"""No actor of a pool outlives it: what the driver does after Ray Data's teardown of a pool.

Ray Data ends a pool's actors in its executor's shutdown, which runs once: the first call
sets the executor's shut-down flag, later calls return at once. The driver's call (closing
the batch iterator when the pool ends or the job stops early) kills the actors. Two ways
left them alive and holding their CPUs or GPUs, so that the next job's pool in the same Ray
session (a `--resume` right after, a test suite's next job) waited for them for
`wait_for_min_actors_s` (30 min):

- an asynchronous interrupt landing inside that shutdown (a lost lease's SIGINT, or SIGTERM,
  while the pool was being torn down after a storage error): the flag was set, the kill
  never ran, and every later shutdown returned at once. The driver now holds signals while it
  tears a pool down (`pipeline.driver._Signals.held`, `PoolRun.hold`);
- a shutdown by Ray Data's own iterator thread first (the pool exhausted, or failed) only
  drops the actors' handles: an actor ends when the last handle is gone, which a traceback
  kept alive in a reference cycle delays until Python's cycle collector runs.

`PoolActors` notes the live actors of the worker's class before the pool starts; `end()`
kills the ones the pool added that are still alive after the teardown and waits (bounded)
until Ray reports them dead. Pool actors are told apart by the class name Ray Data gives
them (`MapWorker(MapBatches(<worker class>))`) and this driver's Ray job id. The actor table
and the kill by id are Ray internals (pinned by pyproject's `ray>=2.60,<2.61`); when they are
unavailable (a Ray Client connection) nothing is done beyond Ray Data's own teardown.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

END_WAIT_S = 10.0  # at most this long for Ray to report the killed actors dead
POLL_S = 0.05


def pool_class_name(worker: type) -> str:
    """The class name Ray Data's actor pool gives the actors running `worker`."""
    return f"MapBatches({worker.__name__}))"


class PoolActors:
    """The actors one pool of `worker` starts, told apart from those alive before it."""

    def __init__(self, worker: type, say: Callable[[str], None] = lambda _: None):
        self.suffix = pool_class_name(worker)
        self.say = say
        self.job_id = self._job_id()
        self.before = self.alive() or set()

    @staticmethod
    def _job_id() -> Optional[str]:
        try:
            import ray

            return ray.get_runtime_context().get_job_id()
        except Exception:  # noqa: BLE001 - no connected driver: nothing to track
            return None

    def alive(self) -> Optional[set[str]]:
        """Ids of this driver job's actors of the pool's class that Ray does not report dead
        (None when the actor table cannot be read)."""
        if self.job_id is None:
            return None
        try:
            from ray._private import state

            table = state.actors()
        except Exception:  # noqa: BLE001 - a private API (absent under Ray Client): nothing to check
            return None
        return {aid for aid, a in table.items()
                if a.get("State") != "DEAD" and a.get("JobID") == self.job_id
                and str(a.get("ActorClassName", "")).startswith("MapWorker(")
                and str(a.get("ActorClassName", "")).endswith(self.suffix)}

    def left(self) -> set[str]:
        """The pool's actors still alive now."""
        now = self.alive()
        return set() if now is None else now - self.before

    def end(self, wait_s: float = END_WAIT_S, poll_s: float = POLL_S,
            clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> set[str]:
        """Kill the pool's actors still alive and wait until Ray reports them dead (at most
        `wait_s`); returns the ones still alive then (said in a WARNING line)."""
        left = self.left()
        if not left:
            return left
        for actor_id in left:
            _kill(actor_id)
        deadline = clock() + wait_s
        while left and clock() < deadline:
            sleep(poll_s)
            left = self.left() & left
        if left:
            self.say(f"WARNING: {len(left)} actor(s) of the finished pool still alive {wait_s:g} s after it was "
                     f"stopped (their CPUs/GPUs stay held until Ray ends them): {', '.join(sorted(left))}")
        return left


def _kill(actor_id: str) -> None:
    """ray.kill(no_restart=True) by actor id: the pool's handles are Ray Data's, not ours."""
    try:
        import ray
        from ray._private.worker import global_worker

        global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
    except Exception:  # noqa: BLE001 - its handle already gone here: Ray ends it as out of scope
        pass
