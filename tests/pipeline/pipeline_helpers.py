"""Helpers shared by the pipeline tests (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def write_prompts(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    """Write prompt rows as one Parquet file (columns from the dicts unless `schema` given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows, schema=schema) if schema else pa.Table.from_pylist(rows)
    pq.write_table(table, path)
    return path


def simple_rows(n: int, start: int = 0, prefix: str = "p") -> list[dict]:
    return [{"prompt_id": f"{prefix}{i:03d}", "prompt": f"a smiling face number {i}", "seed": i} for i in range(start, start + n)]


def live_pool_actors(worker: str = "GeneratorWorker") -> set[str]:
    """Ids of the generator pool actors (Ray Data's `MapWorker(MapBatches(<worker>))`) that the
    connected Ray does not report dead: the GCS actor table, which Ray's state API reads (the
    session's Ray runs without the dashboard that ray.util.state.list_actors goes through)."""
    from ray._private import state

    return {aid for aid, a in state.actors().items()
            if a["State"] != "DEAD" and a["ActorClassName"].startswith("MapWorker(")
            and a["ActorClassName"].endswith(f"MapBatches({worker}))")}
