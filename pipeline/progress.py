"""Progress of a run with a known total: done / total, images/s and an ETA.

In a terminal the driver draws one bar that redraws in place; in logs and CI (no terminal,
e.g. `ray job submit`, which keeps no carriage returns) it prints plain lines: one at every
tenth of the images, one every `interval_s` even when nothing finished (so a long start-up
reads as waiting, not as a hang: that gap doubles while no image has finished), and one at
the end. The driver knows the total: the prompts
it selected.

Other libraries' progress output is off unless `--progress` asks for it (`quiet_progress_bars`,
`quiet_ray_data`): Ray Data's "Total Progress" bars and per-dataset logs, Hugging Face's
download and "Loading weights" bars.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Optional, TextIO

BAR_WIDTH = 24
TENTHS = 10  # a plain line at every tenth of the images
WAIT_CAP_S = 60.0  # the longest gap between lines while waiting for the first images


def format_duration(seconds: float) -> str:
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class Progress:
    """Counts rows as they arrive and says where the run is (`say`, one line each time):
    at every tenth of the total, at least every `interval_s` (`tick`, also while no row
    arrives), and at the last row. With `bar` (a terminal) it redraws one bar line there
    instead. The rate is measured from the first rows, so actor start-up and bundle loading
    do not drag the ETA."""

    def __init__(self, total: int, say: Callable[[str], None], interval_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, bar: Optional[TextIO] = None):
        self.total, self.say, self.interval_s, self.clock, self.bar = total, say, interval_s, clock, bar
        self.bar_open = False  # the bar is on the terminal's current line (no newline after it)
        self.lock = threading.RLock()  # bar redraws vs. foreign output (Ray's log thread)
        self.done = self.ok = 0
        self.started = clock()
        self.first: Optional[tuple[float, int]] = None  # (time, rows) of the first rows
        self.last_said: Optional[float] = None
        self.tenth_said = 0  # the last tenth of the total a line was said at
        self.rows_said = False  # a line was said since rows started arriving
        self.lines = 0  # lines said (or bar redraws)

    def add(self, rows: int, ok: int) -> None:
        now = self.clock()
        self.done += rows
        self.ok += ok
        if self.first is None:
            self.first = (now, self.done)
        self._maybe_say(now, new_rows=True)

    def tick(self) -> None:
        """Called every second or so while the run goes on: the heartbeat and the bar's clock."""
        if self.done < self.total:
            self._maybe_say(self.clock(), new_rows=False)

    def _maybe_say(self, now: float, new_rows: bool) -> None:
        if self.bar is not None:
            with self.lock:
                self._draw(now)
            return
        tenth = self.done * TENTHS // self.total if self.total else TENTHS
        first_rows = new_rows and not self.rows_said
        due = now - (self.started if self.last_said is None else self.last_said) >= self._interval()
        if not (self.done >= self.total or tenth > self.tenth_said or first_rows or due):
            return
        self.last_said, self.tenth_said = now, max(self.tenth_said, tenth)
        self.rows_said = self.rows_said or new_rows
        self.lines += 1
        self.say(self.line(now))

    def _interval(self) -> float:
        """interval_s; while no image has finished it doubles after each line (up to a minute),
        so a long start-up reads as waiting without a wall of identical lines."""
        if self.first is not None:
            return self.interval_s
        return min(max(self.interval_s, WAIT_CAP_S), self.interval_s * 2 ** self.lines)

    def rate(self, now: float) -> Optional[float]:
        """Images/s since the first rows (for the ETA), once rows have come in over at least
        `interval_s` (a one-wave job's images arrive together: a rate over a burst means
        nothing); None at the end, where the summary's `time` line gives the run's rate."""
        if self.done >= self.total or self.first is None or self.done <= self.first[1]:
            return None
        if now - self.first[0] < self.interval_s:
            return None
        return (self.done - self.first[1]) / (now - self.first[0])

    def line(self, now: float) -> str:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = f"progress {self.done}/{self.total} ({pct:.1f}%), ok {self.ok}"
        if self.first is None:
            return text + f", waiting for the first images ({format_duration(now - self.started)} since the pool started)"
        rate = self.rate(now)
        if self.done >= self.total:
            text += f", done {format_duration(now - self.started)} after the pool started"
        elif rate:
            text += f", {rate:.2f} images/s, ETA {format_duration(max(0, self.total - self.done) / rate)}"
        return text

    def _draw(self, now: float) -> None:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(BAR_WIDTH * frac))
        rate = self.rate(now)
        tail = (f"done in {format_duration(now - self.started)}" if self.done >= self.total else
                f"{rate:.2f} images/s, ETA {format_duration(max(0, self.total - self.done) / rate)}" if rate else
                f"waiting for the first images ({format_duration(now - self.started)})" if self.first is None else "")
        text = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done}/{self.total} {100 * frac:.0f}% ok {self.ok} {tail}"
        end = "\n" if self.done >= self.total else ""
        self.bar.write(f"\r{text}\x1b[K{end}")
        self.bar.flush()
        self.bar_open = not end
        self.lines += 1
        self.last_said = now

    @contextlib.contextmanager
    def foreign_output_below(self) -> Iterator[None]:
        """While a bar is drawn, text written to sys.stdout / sys.stderr by anyone else (Ray's
        forwarded worker lines, warnings) starts on a cleared line instead of after the bar, and
        the bar is drawn again under each finished line. No-op without a bar."""
        if self.bar is None:
            yield
            return
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _BelowBar(sys.stdout, self), _BelowBar(sys.stderr, self)
        try:
            yield
        finally:
            sys.stdout, sys.stderr = saved


class _BelowBar:
    """A stream in front of sys.stdout / sys.stderr for `Progress.foreign_output_below`."""

    def __init__(self, inner: TextIO, progress: Progress):
        self._inner, self._progress = inner, progress

    def write(self, text: str) -> int:
        p = self._progress
        with p.lock:
            if text and p.bar_open:
                p.bar.write("\r\x1b[K")  # clear the bar's line; the text takes it
                p.bar.flush()
                p.bar_open = False
            n = self._inner.write(text)
            if text.endswith("\n") and p.done < p.total and p.lines:
                self._inner.flush()
                p._draw(p.clock())  # the bar again, under the foreign line
            return n

    def flush(self) -> None:
        self._inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


def quiet_progress_bars(show: bool = False) -> None:
    """Hugging Face's progress bars (downloads, transformers' "Loading weights") off, unless
    `show`; a HF_HUB_DISABLE_PROGRESS_BARS the user set wins."""
    if show:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # libraries imported later
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"].lower() not in ("1", "true", "yes", "on"):
        return
    if "huggingface_hub" in sys.modules:  # already imported: its flag was read at import
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


# Ray Data loggers that print progress, and the level that keeps only what matters: the logged
# "Total Progress" blocks and the notice that bars are off (a warning); the per-dataset start,
# plan and finish lines (info).
_RAY_DATA_PROGRESS_LOGGERS = {"ray.data._internal.progress": logging.ERROR,
                              "ray.data._internal.execution.streaming_executor": logging.WARNING,
                              "ray.data._internal.datasource.parquet_datasource": logging.WARNING}  # reader batch size


def quiet_ray_data(context: Any, show: bool = False) -> None:
    """Ray Data's own progress bars and progress logs for executions under `context` (a
    DataContext): off unless `show`; warnings and errors still print."""
    context.enable_progress_bars = show
    for name, level in _RAY_DATA_PROGRESS_LOGGERS.items():
        logging.getLogger(name).setLevel(logging.NOTSET if show else level)
