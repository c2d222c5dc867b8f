"""What the report reads from a job's outputs, and nothing more.

Two passes over the telemetry: the light columns of every row (`LIGHT_COLUMNS`, about 100
bytes a row: 100k rows read in well under a second), then one streamed pass over the
per-round traces (`rounds`), record batch by record batch, that accumulates the ADT-Tree
maps of at most `max_map_rows` images and keeps the traces of the few images drawn alone.
Images are fetched only for the sample grid.
"""

from __future__ import annotations

import io
import json
import logging
import tarfile
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.ledger import latest_per_prompt, read_telemetry
from pipeline.storage import Storage
from pipeline.telemetry import STATUS_OK, TELEMETRY_DIR

log = logging.getLogger(__name__)

LIGHT_COLUMNS = ["prompt_id", "prompt", "status", "error", "image_key", "method", "grid_h", "grid_w", "actor_id",
                 "finished_at", "generation_time_ms", "baseline_time_ms", "speedup", "estimated_speedup", "estimated_speedup_model",
                 "mean_acceptance_length", "draft_acceptance_rate", "num_spec_steps", "accepted_lengths"]
MAP_KEYS = ("depth", "width", "accepted")


@dataclass
class TreeMaps:
    """Sums per grid cell over the images seen: mean = sums / counts."""

    grid: tuple[int, int]
    sums: dict[str, np.ndarray]  # (H*W,) float64 each
    counts: np.ndarray  # (H*W,) images that committed the cell in a speculative round
    images: int = 0
    singles: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # prompt id -> its rounds

    def mean(self, key: str) -> np.ndarray:
        h, w = self.grid
        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.sums[key] / np.where(self.counts > 0, self.counts, np.nan)).reshape(h, w)


@dataclass
class JobData:
    uri: str
    config: dict[str, Any]  # job.json ({} when absent)
    summary: dict[str, Any]  # summary.json ({} when absent)
    rows: pa.Table  # LIGHT_COLUMNS, one row per prompt (latest_per_prompt)
    all_rows: int  # telemetry rows across runs, before keeping one per prompt
    maps: Optional[TreeMaps]


def _json(store: Storage, key: str) -> dict[str, Any]:
    try:
        return json.loads(store.get_text(key)) if store.exists(key) else {}
    except ValueError:
        log.warning("%s is not valid JSON: left out", store.uri_for(key))
        return {}


def job_json(store: Storage) -> dict[str, Any]:
    """The job's job.json ({} when there is none)."""
    return _json(store, "job.json")


def load(store: Storage, max_map_rows: int = 5000, singles: int = 3) -> JobData:
    table = read_telemetry(store, columns=LIGHT_COLUMNS)
    if table is None:
        raise FileNotFoundError(f"no telemetry under {store.uri_for(TELEMETRY_DIR)}: is this a job's output?")
    total = table.num_rows
    rows = latest_per_prompt(table)
    picked = pick_singles(rows, singles)
    maps = tree_maps(store, rows, max_map_rows, picked)
    return JobData(store.uri, job_json(store), _json(store, "summary.json"), rows, total, maps)


def ok_rows(rows: pa.Table) -> pa.Table:
    return rows.filter(pc.fill_null(pc.equal(rows["status"], STATUS_OK), False))


def pick_singles(rows: pa.Table, n: int) -> list[str]:
    """Ids of up to n speculative ok images: the lowest, median and highest acceptance."""
    ok = ok_rows(rows)
    ok = ok.filter(pc.fill_null(pc.greater(ok["num_spec_steps"], 0), False))
    if ok.num_rows == 0 or n <= 0:
        return []
    ok = ok.sort_by([("mean_acceptance_length", "ascending"), ("prompt_id", "ascending")])
    idx = sorted({int(round(i)) for i in np.linspace(0, ok.num_rows - 1, min(n, ok.num_rows))})
    return [ok["prompt_id"][i].as_py() for i in idx]


def _accumulate(maps: TreeMaps, rounds: pa.ListArray) -> None:
    """Add a batch of images' round traces to the sums (vectorised over rounds and cells)."""
    h, w = maps.grid
    flat = rounds.flatten()
    if len(flat) == 0:
        return
    img = np.repeat(np.arange(len(rounds)), np.diff(rounds.offsets.to_numpy()))
    pos = flat.field("position").to_numpy(zero_copy_only=False).astype(np.int64)
    acc = flat.field("accepted").to_numpy(zero_copy_only=False).astype(np.int64)
    vals = {"depth": flat.field("depth").to_numpy(zero_copy_only=False).astype(float),
            "width": flat.field("width").to_numpy(zero_copy_only=False).astype(float), "accepted": acc + 1.0}
    span = acc + 1  # cells a round commits: its accepted draft tokens and the bonus token
    r = np.repeat(np.arange(len(pos)), span)
    cell = pos[r] + (np.arange(len(r)) - np.repeat(np.cumsum(span) - span, span))
    keep = cell < h * w
    r, cell = r[keep], cell[keep]
    for k in MAP_KEYS:
        np.add.at(maps.sums[k], cell, vals[k][r])
    seen = np.zeros((len(rounds), h * w), dtype=bool)
    seen[img[r], cell] = True
    maps.counts += seen.sum(axis=0)


def tree_maps(store: Storage, rows: pa.Table, max_rows: int, singles: list[str]) -> Optional[TreeMaps]:
    """Mean depth / width / accepted length per cell over up to `max_rows` speculative ok
    images, and the traces of `singles`, from one streamed pass over the `rounds` column."""
    ok = ok_rows(rows)
    ok = ok.filter(pc.fill_null(pc.greater(ok["num_spec_steps"], 0), False))
    if ok.num_rows == 0:
        return None
    h, w = int(ok["grid_h"][0].as_py()), int(ok["grid_w"][0].as_py())
    maps = TreeMaps((h, w), {k: np.zeros(h * w) for k in MAP_KEYS}, np.zeros(h * w, dtype=np.int64))
    wanted = pa.array(ok["prompt_id"].to_pylist()[:max_rows], pa.string())  # the images the maps average
    single_set = pa.array(singles, pa.string())
    fs = store.arrow_fs()
    for key in sorted(k for k in store.list_keys(TELEMETRY_DIR) if k.endswith(".parquet")):
        try:
            pf = pq.ParquetFile(fs.open_input_file(store.arrow_path(key)))
            if "rounds" not in pf.schema_arrow.names:
                continue
            for batch in pf.iter_batches(batch_size=1024, columns=["prompt_id", "status", "grid_h", "grid_w", "rounds"]):
                b = pa.Table.from_batches([batch])
                b = b.filter(pc.fill_null(pc.equal(b["status"], STATUS_OK), False))
                b = b.filter(pc.and_(pc.equal(b["grid_h"], h), pc.equal(b["grid_w"], w)))
                for row in b.filter(pc.is_in(b["prompt_id"], value_set=single_set)).to_pylist():
                    maps.singles.setdefault(row["prompt_id"], row["rounds"] or [])
                room = max_rows - maps.images
                if room > 0:
                    m = b.filter(pc.is_in(b["prompt_id"], value_set=wanted)).slice(0, room)
                    if m.num_rows:
                        _accumulate(maps, m["rounds"].combine_chunks())
                        maps.images += m.num_rows
        except Exception as e:  # noqa: BLE001 - one damaged file leaves the rest of the report
            log.warning("skipping %s for the tree maps: %s", store.uri_for(key), e)
        if maps.images >= max_rows and len(maps.singles) >= len(singles):
            break
    return maps if maps.images else None


def pick_samples(rows: pa.Table, n: int) -> list[dict[str, Any]]:
    """Up to n ok rows spread evenly over the job (in prompt id order)."""
    ok = ok_rows(rows).sort_by("prompt_id")
    if ok.num_rows == 0 or n <= 0:
        return []
    idx = sorted({int(round(i)) for i in np.linspace(0, ok.num_rows - 1, min(n, ok.num_rows))})
    return ok.take(pa.array(idx, pa.int64())).select(["prompt_id", "prompt", "image_key"]).to_pylist()


def image_png(store: Storage, row: dict[str, Any]) -> Optional[bytes]:
    """The PNG bytes of one row's image, from images/ or from its shard; None if unreadable."""
    key = row.get("image_key")
    if not key:
        return None
    try:
        if key.endswith(".png"):
            return store.get_bytes(key)
        from pipeline.shards import sample_key

        name = sample_key(row["prompt_id"])
        data = store.get_bytes(key)
        if key.endswith(".tar"):
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = tar.extractfile(f"{name}.png")
                return member.read() if member else None
        t = pq.read_table(io.BytesIO(data), columns=["key", "image"])
        hit = t.filter(pc.equal(t["key"], name))
        image = hit["image"][0].as_py() if hit.num_rows else None
        return image["bytes"] if isinstance(image, dict) else image  # HF image struct (older shards: bytes)
    except Exception as e:  # noqa: BLE001 - a missing image leaves a gap, not a failed report
        log.warning("cannot read the image of %s (%s): %s", row.get("prompt_id"), key, e)
        return None
