"""The engine's cost tables, kept in the job outputs.

The cost-aware budget reads a table of target-forward and draft-level costs measured on the
device at the engine's batch size (adt_core/calibrate.py). The first actor of a job that needs
one measures it and stores it at `costs/<device>-<dtype>-b<batch>.json` under the output root;
every later actor (and a resumed run) loads that file instead of measuring again, so all of a
job's images are budgeted from one table. A table that cannot be read or written is measured
locally and the job goes on (the budget never changes images).
"""

from __future__ import annotations

import logging
import re

from adt_core.calibrate import CostTable

log = logging.getLogger(__name__)

COSTS_DIR = "costs"


def costs_key(device_name: str, dtype: str, batch: int) -> str:
    """Object key of the table for a device (e.g. 'cpu', 'cuda:0 (NVIDIA H200)'), dtype and batch."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "device"
    return f"{COSTS_DIR}/{slug}-{dtype}-b{batch}.json"


def attach_costs(generator, storage, device_name: str) -> str:
    """Give `generator` the job's stored table, or measure and store it; returns 'loaded',
    'measured' or 'unused' (methods without a cost budget or speedup estimate: ar)."""
    if generator.config.method == "ar":
        return "unused"
    key = costs_key(device_name, generator.config.dtype, generator.config.batch_size)
    try:
        if storage.exists(key):
            generator.use_costs(CostTable.from_json(storage.get_text(key)))
            return "loaded"
    except Exception as e:  # noqa: BLE001 - a damaged or unreadable table is measured again
        log.warning("cost table %s unreadable (%s): measuring", key, e)
    table = generator.cost_table()
    try:
        storage.put_text(key, table.to_json(), content_type="application/json")
    except Exception as e:  # noqa: BLE001 - the job goes on with the local table
        log.warning("cost table %s not stored (%s)", key, e)
    return "measured"
