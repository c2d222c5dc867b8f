"""Test-only GeneratorWorker subclasses for the actor pool, passed to the driver as
`run_job(cfg, worker=...)`; production code knows nothing of them.

- `kill_once_worker(marker)`: SIGKILLs its own actor process once, right after storing the
  first image of a batch of several prompts (mid-batch), so Ray restarts the actor and
  retries the batch.
- `kill_recut_worker(marker)`: as kill_once_worker, but the killed attempt hands each row on
  as a chunk of its own and the retry hands the batch on as one chunk, so the retry's chunks
  line up with none of the first attempt's (Ray passes on a retry's chunks by position):
  without the driver's redo pass, the batch's unfinished prompts would get no row.
- `placed(cls, folder)`: `cls` that also writes, as each actor starts, where Ray placed it
  (actor id, node id, GPU ids, process id, engine device, wall-clock time once its bundle is
  loaded) as one JSON file in `folder`.
- `paced_worker(seconds, until=None, then_s=0.0)`: takes at least `seconds` per image, like a
  bigger model, so that images finish one by one at a known pace whatever the machine's load;
  with `until`, `then_s` per image once that file exists (a test waiting for an event, e.g. the
  pool growing, keeps the job running until it happened and then lets it end quickly).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import ray.cloudpickle

from pipeline.worker import GeneratorWorker, unpack

# Ray's actors cannot import this file (tests/ is not a package on their path): ship it by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def kill_once_worker(marker: Path) -> type:
    """The worker class whose first actor to store an image mid-batch creates `marker` and
    kills itself (once per marker file)."""
    return type("KillOnceWorker", (_KillOnce,), {"marker": str(marker)})


def kill_recut_worker(marker: Path, after_images: int = 2) -> type:
    return type("KillRecutWorker", (_KillRecut,), {"marker": str(marker), "after_images": after_images})


def placed(cls: type, folder: Path) -> type:
    return type("Placed" + cls.__name__, (_Placed, cls), {"folder": str(folder)})


def placements(folder: Path) -> list[dict]:
    import json

    return [json.loads(p.read_text()) for p in sorted(Path(folder).glob("*.json"))]


def paced_worker(seconds: float, until: Path | None = None, then_s: float = 0.0) -> type:
    return type("PacedWorker", (_Paced,), {"seconds": seconds, "until": str(until or ""), "then_s": then_s})


class _Paced(GeneratorWorker):
    """Each image finishes `seconds` after the one before (the engine's pace, not the writer's)."""

    seconds = 0.0
    until = ""  # a file: once it exists, each image takes then_s instead
    then_s = 0.0

    def _stream(self, prompts):
        for item in super()._stream(prompts):
            if item is not None:  # an image, not a round's tick
                time.sleep(self.then_s if self.until and os.path.exists(self.until) else self.seconds)
            yield item


class _KillOnce(GeneratorWorker):
    marker = ""
    kill_on_put = True  # (a writer thread) right after an image of the batch is stored

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch_rows = 0
        put = self.storage.put_bytes

        def put_then_maybe_die(key, data, content_type=None):
            put(key, data, content_type)
            if self.in_actor and self.batch_rows > 1 and key.startswith("images/") and type(self).kill_on_put:
                self._die_once()

        self.storage.put_bytes = put_then_maybe_die

    def __call__(self, batch):
        self.batch_rows = batch.num_rows
        yield from super().__call__(batch)

    def _die_once(self) -> None:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


class _KillRecut(_KillOnce):
    """Dies from the yielding thread once `after_images` ok rows have been handed on (taken by
    the consumer) and the batch has more to come; the killed attempt decodes at 0.3 s per image
    so its rows leave one by one."""

    after_images = 2
    kill_on_put = False

    def __call__(self, batch):
        import pipeline.worker as w

        first = not os.path.exists(self.marker)
        w.YIELD_EVERY_S = 0.0 if first else 1e9  # this process only: per row, then per batch
        self.seconds = 0.3 if first else 0.0
        handed = 0
        for chunk in GeneratorWorker.__call__(self, batch):
            yield chunk
            handed += sum(s == "ok" for s in unpack(chunk)["status"].to_pylist())  # taken: the consumer asks on
            if self.in_actor and self.after_images <= handed < batch.num_rows:
                time.sleep(0.3)  # the chunk reaches the driver
                self._die_once()

    def _stream(self, prompts):
        for item in super()._stream(prompts):
            if item is not None:  # an image, not a round's tick
                time.sleep(self.seconds)
            yield item


class _Placed(GeneratorWorker):
    folder = ""

    def __init__(self, *args, **kwargs):
        import json

        super().__init__(*args, **kwargs)
        ctx = ray.get_runtime_context()
        doc = {"actor_id": ctx.get_actor_id(), "node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
               "pid": os.getpid(), "device": self.device, "ready_at": time.time()}
        tmp = Path(self.folder, f".{os.getpid()}.tmp")  # whole or absent for a reader polling the folder
        tmp.write_text(json.dumps(doc))
        tmp.rename(Path(self.folder, f"{os.getpid()}.json"))
