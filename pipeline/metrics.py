"""Application metrics through `ray.util.metrics`, exported by every Ray node's metrics agent
to Ray's Prometheus endpoint (names get Ray's `ray_` prefix there; infra/grafana-dashboard.json
charts them):

    adt_images_done            counter    images stored (ok rows)
    adt_images_failed          counter    failed rows
    adt_acceptance_length      histogram  mean acceptance length per image (tokens per round)
    adt_speedup                histogram  measured speedup (baseline rows) per image
    adt_image_time_ms          histogram  engine time per image, ms

each labelled `method` and `bundle`. Outside a Ray worker (tests, the engine alone) the
recorder does nothing.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

TAGS = ("method", "bundle")
ACCEPTANCE_BOUNDS = [1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0]
SPEEDUP_BOUNDS = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0]
TIME_BOUNDS_MS = [10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000]


class WorkerMetrics:
    """Records each row of one worker; a no-op when Ray is not running in this process."""

    def __init__(self, method: str, bundle: str):
        self.tags = {"method": method, "bundle": bundle}
        self.enabled = False
        try:
            import ray
            from ray.util.metrics import Counter, Histogram

            if not ray.is_initialized():
                return
            self.done = Counter("adt_images_done", "images generated and stored (ok rows)", tag_keys=TAGS)
            self.failed = Counter("adt_images_failed", "prompts whose row failed", tag_keys=TAGS)
            self.acceptance = Histogram("adt_acceptance_length", "mean acceptance length per image (tokens per round)",
                                        boundaries=ACCEPTANCE_BOUNDS, tag_keys=TAGS)
            self.speedup = Histogram("adt_speedup", "measured speedup vs vanilla AR per baseline image",
                                     boundaries=SPEEDUP_BOUNDS, tag_keys=TAGS)
            self.time_ms = Histogram("adt_image_time_ms", "engine time per image in milliseconds",
                                     boundaries=TIME_BOUNDS_MS, tag_keys=TAGS)
            self.enabled = True
        except Exception as e:  # noqa: BLE001 - metrics must never stop generation
            log.warning("application metrics disabled: %s", e)

    def record(self, rows: list[Optional[dict[str, Any]]]) -> None:
        if not self.enabled:
            return
        try:
            for r in rows:
                if r is None:
                    continue
                if r.get("status") != "ok":
                    self.failed.inc(1, tags=self.tags)
                    continue
                self.done.inc(1, tags=self.tags)
                for metric, key in ((self.acceptance, "mean_acceptance_length"), (self.speedup, "speedup"),
                                    (self.time_ms, "generation_time_ms")):
                    if r.get(key) is not None:
                        metric.observe(float(r[key]), tags=self.tags)
        except Exception as e:  # noqa: BLE001
            log.warning("recording metrics failed: %s", e)
