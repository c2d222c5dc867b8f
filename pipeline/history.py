"""What made an output: job.json (the config of the job's first run, never rewritten) and
one record per run under runs/<run id>.json (its config, hash, start, end and counts).

A resume whose config would decide images differently (another config_hash) is refused,
naming the fields that differ, unless JobConfig.allow_config_change says so; the run's
record then keeps its own config beside the first one.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any, Optional

from pipeline.config import CONFIG_FILE, JobConfig
from pipeline.storage import Storage

RUNS_DIR = "runs"


class ConfigChanged(ValueError):
    """A resume with a config that would make different images (exit code 2)."""


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("."): d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}."))
    return out


def changed_fields(old: dict[str, Any], new: JobConfig) -> list[str]:
    """Dotted names of the fields that decide images and differ between `old` (a job.json) and `new`."""
    keys = ("bundle", "decode", "seed", "max_prompt_chars", "baseline_fraction")
    a = _flat({k: old.get(k) for k in keys})
    b = _flat(new.model_dump(mode="json", include=set(keys)))
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def check_and_record(output: Storage, cfg: JobConfig, run_id: str) -> Optional[str]:
    """Write job.json for a new output, or check a resumed one's; returns the first config's
    hash when it differs from this run's (and the change is allowed), else None."""
    record = {"run_id": run_id, "started_at": _now(), "config_hash": cfg.config_hash(),
              "config": json.loads(cfg.to_json())}
    earlier_hash = None
    if output.exists(CONFIG_FILE):
        first = json.loads(output.get_text(CONFIG_FILE))
        earlier_hash = first.get("config_hash")
        if earlier_hash and earlier_hash != cfg.config_hash():
            fields = changed_fields(first, cfg)
            if not cfg.allow_config_change:
                raise ConfigChanged(
                    f"{output.uri} was made with config {earlier_hash}; this run's config {cfg.config_hash()} would "
                    f"decide images differently ({', '.join(fields[:8]) or 'hash'}): use the same settings, another "
                    f"--output, or --allow-config-change to mix them")
            record["changed_from"] = {"config_hash": earlier_hash, "fields": fields}
    else:
        output.put_text(CONFIG_FILE, cfg.to_json(), "application/json")
    output.put_text(f"{RUNS_DIR}/{run_id}.json", json.dumps(record, indent=2) + "\n", "application/json")
    return earlier_hash if earlier_hash and earlier_hash != cfg.config_hash() else None


def finish_record(output: Storage, cfg: JobConfig, run_id: str, outcome: dict[str, Any]) -> None:
    """Add the run's end, exit code and counts to its record."""
    key = f"{RUNS_DIR}/{run_id}.json"
    record = json.loads(output.get_text(key)) if output.exists(key) else {"run_id": run_id}
    record.update(finished_at=_now(), **outcome)
    output.put_text(key, json.dumps(record, indent=2, default=str) + "\n", "application/json")


def run_records(output: Storage) -> list[dict[str, Any]]:
    """Every run's record, oldest first."""
    keys = [k for k in output.list_keys(RUNS_DIR) if k.endswith(".json")]
    return sorted((json.loads(output.get_text(k)) for k in keys), key=lambda r: r.get("started_at", ""))
