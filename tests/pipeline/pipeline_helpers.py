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
