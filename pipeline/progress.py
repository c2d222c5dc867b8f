"""Progress of a run with a known total: done / total, images/s and an ETA, as plain lines
(they read the same on a terminal and in `ray job submit` logs, which keep no carriage
returns). The driver knows the total: the prompts it selected."""

from __future__ import annotations

import time
from typing import Callable, Optional


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Counts rows as batches arrive and says where the run is at most every `interval_s`
    (and at the last row). The rate is measured from the first batch, so actor start-up and
    bundle loading do not drag the ETA."""

    def __init__(self, total: int, say: Callable[[str], None], interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.say, self.interval_s, self.clock = total, say, interval_s, clock
        self.done = self.ok = 0
        self.first: Optional[tuple[float, int]] = None  # (time, rows) of the first batch
        self.last_said: Optional[float] = None

    def add(self, rows: int, ok: int) -> None:
        now = self.clock()
        self.done += rows
        self.ok += ok
        if self.first is None:
            self.first = (now, self.done)
        finished = self.done >= self.total
        if not finished and self.last_said is not None and now - self.last_said < self.interval_s:
            return
        self.last_said = now
        self.say(self.line(now))

    def rate(self, now: float) -> Optional[float]:
        if self.first is None or now <= self.first[0] or self.done <= self.first[1]:
            return None
        return (self.done - self.first[1]) / (now - self.first[0])

    def line(self, now: float) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.rate(now)
        text = f"progress {self.done}/{self.total} ({pct:.1f}%), ok {self.ok}"
        if rate:
            left = max(0, self.total - self.done)
            text += f", {rate:.2f} images/s, ETA {format_duration(left / rate)}"
        return text
