"""Outputs people load as datasets: `--output-format files | webdataset | parquet`.

    files       images/<id>.png, plus images/metadata.parquet (file_name + caption + the main
                telemetry columns) so `datasets.load_dataset("imagefolder", data_dir=<output>/images)`
                loads captions and stats beside the images
    webdataset  shards/<name>.tar: <key>.png, <key>.json (the row's SAMPLE_COLUMNS), <key>.txt
                (the caption), the layout WebDataset, Ray Data `read_webdataset` and most
                image-training loaders read
    parquet     shards/<name>.parquet: one row per image, `key`, `image` and the SAMPLE_COLUMNS;
                `image` is HF datasets' image struct {bytes: PNG, path: <key>.png} and the
                schema metadata records the features, so `datasets.load_dataset("parquet",
                data_dir=<output>/shards)` yields Image() and captions with no cast

A worker writes the shards of one call itself, after that call's images finished and before
it returns their rows, so an ok row always means its shard holds the image (the per-row
status design; Ray Data's `write_webdataset` would write after the rows reached the driver,
and its rows would have to carry the image bytes through the object store twice). A shard
name is a pure function of the sample keys in it (`<sha256 prefix>-n<count>`): a retried
call rewrites the same object. A shard can still hold images no durable row points to (the
driver was killed after the worker wrote it, so a resume decoded those prompts again into
another shard); `finalize` at the end of every run keeps every prompt in exactly one shard,
the one its latest ok row names, rewriting or deleting the others.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import logging
import re
import tarfile
from dataclasses import dataclass
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.storage import Storage, safe_name
from pipeline.telemetry import SAMPLE_COLUMNS, SCHEMA

log = logging.getLogger(__name__)

SHARD_DIR = "shards"
METADATA_KEY = "images/metadata.parquet"
EXTENSIONS = {"webdataset": "tar", "parquet": "parquet"}
_COUNT = re.compile(r"-n(\d+)\.[a-z]+$")


def sample_key(prompt_id: str) -> str:
    """The key of a prompt's sample inside a shard: `safe_name`, without dots (WebDataset
    splits a member name at its first dot into key and extension)."""
    name = safe_name(prompt_id)
    if "." not in name:
        return name
    digest = hashlib.sha256(prompt_id.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{name.replace('.', '_')}-{digest}"


@dataclass
class Sample:
    """One finished image on its way into a shard."""

    key: str  # sample_key(prompt id)
    png: bytes
    row: dict[str, Any]  # the telemetry row; image_key is set when the shard is written


def shard_key(fmt: str, keys: list[str]) -> str:
    digest = hashlib.sha256("\n".join(sorted(keys)).encode()).hexdigest()[:16]
    return f"{SHARD_DIR}/{digest}-n{len(keys)}.{EXTENSIONS[fmt]}"


def _sample_fields(row: dict[str, Any]) -> dict[str, Any]:
    return {c: row.get(c) for c in SAMPLE_COLUMNS}


def _json_default(x: Any) -> Any:
    return x.isoformat() if isinstance(x, (dt.datetime, dt.date)) else str(x)


def _tar_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # no clock, uid or host in the bytes
    tar.addfile(info, io.BytesIO(data))


def encode_tar(samples: list[Sample]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for s in sorted(samples, key=lambda s: s.key):
            _tar_member(tar, f"{s.key}.png", s.png)
            _tar_member(tar, f"{s.key}.json", json.dumps(_sample_fields(s.row), default=_json_default,
                                                         sort_keys=True).encode())
            _tar_member(tar, f"{s.key}.txt", (s.row.get("prompt") or "").encode())
    return buf.getvalue()


# The storage of HF datasets' `Image()` feature: PNG bytes plus a file name (its format hint).
IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])
_HF_FLOATS = {"halffloat": "float16", "float": "float32", "double": "float64"}  # arrow name -> datasets dtype


def hf_features(schema: pa.Schema) -> dict[str, dict[str, str]]:
    """The `datasets` Features of a parquet shard: `image` is an Image(), every other
    (scalar) column a Value of its arrow type."""
    return {f.name: {"_type": "Image"} if f.name == "image" else
            {"dtype": _HF_FLOATS.get(str(f.type), str(f.type)), "_type": "Value"} for f in schema}


def _parquet_schema() -> pa.Schema:
    """key, image (HF image struct), the SAMPLE_COLUMNS; the features recorded under the
    `huggingface` metadata key, so `load_dataset("parquet", ...)` decodes images."""
    schema = pa.schema([pa.field("key", pa.string()), pa.field("image", IMAGE_STRUCT)]
                       + [SCHEMA.field(c) for c in SAMPLE_COLUMNS])
    info = {"info": {"features": hf_features(schema)}}
    return schema.with_metadata({"huggingface": json.dumps(info)})


PARQUET_SCHEMA = _parquet_schema()


def encode_parquet(samples: list[Sample]) -> bytes:
    rows = [{"key": s.key, "image": {"bytes": s.png, "path": f"{s.key}.png"}, **_sample_fields(s.row)}
            for s in sorted(samples, key=lambda s: s.key)]
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA), buf)
    return buf.getvalue()


def write_shards(storage: Storage, fmt: str, samples: list[Sample], shard_size: Optional[int]) -> list[tuple[str, list[Sample]]]:
    """Store `samples` as shards of at most `shard_size` (None: one shard) and set every
    row's image_key; returns (shard key, its samples). Raises what the store raises."""
    if not samples:
        return []
    ordered = sorted(samples, key=lambda s: s.key)
    size = shard_size or len(ordered)
    out = []
    for i in range(0, len(ordered), size):
        group = ordered[i:i + size]
        key = shard_key(fmt, [s.key for s in group])
        data = encode_tar(group) if fmt == "webdataset" else encode_parquet(group)
        storage.put_bytes(key, data, "application/x-tar" if fmt == "webdataset" else "application/vnd.apache.parquet")
        for s in group:
            s.row["image_key"] = key
        out.append((key, group))
    return out


# ----------------------------------------------------------------------------------------
# Reading back and keeping every prompt in one shard


def shard_sample_keys(fmt: str, data: bytes) -> list[str]:
    if fmt == "webdataset":
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            return sorted({m.name.split(".", 1)[0] for m in tar.getmembers()})
    return pq.read_table(io.BytesIO(data), columns=["key"])["key"].to_pylist()


def _filter_shard(fmt: str, data: bytes, keep: set[str]) -> bytes:
    if fmt == "parquet":
        table = pq.read_table(io.BytesIO(data))
        buf = io.BytesIO()
        pq.write_table(table.filter(pc.is_in(table["key"], value_set=pa.array(sorted(keep), pa.string()))), buf)
        return buf.getvalue()
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(data)) as src, tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for m in src.getmembers():
            if m.name.split(".", 1)[0] in keep:
                _tar_member(dst, m.name, src.extractfile(m).read())
    return out.getvalue()


def finalize(storage: Storage, fmt: str, latest_ok: pa.Table) -> dict[str, int]:
    """After a run: every shard holds exactly the samples whose latest ok row names it.
    `latest_ok`: one ok row per prompt (prompt_id, image_key). Returns counts."""
    counts = {"shards": 0, "rewritten": 0, "deleted": 0}
    if fmt not in EXTENSIONS:
        return counts
    wanted: dict[str, set[str]] = {}
    for pid, key in zip(latest_ok["prompt_id"].to_pylist(), latest_ok["image_key"].to_pylist()):
        if key and key.startswith(SHARD_DIR + "/"):
            wanted.setdefault(key, set()).add(sample_key(pid))
    for key in storage.list_keys(SHARD_DIR):
        m = _COUNT.search(key)
        if not key.endswith("." + EXTENSIONS[fmt]) or m is None:
            continue
        keep = wanted.get(key, set())
        if not keep:
            storage.delete(key)  # written by a call whose rows never became durable
            counts["deleted"] += 1
            continue
        counts["shards"] += 1
        if len(keep) == int(m.group(1)):
            continue
        data = storage.get_bytes(key)
        if set(shard_sample_keys(fmt, data)) <= keep:
            continue  # filtered by an earlier run already
        storage.put_bytes(key, _filter_shard(fmt, data, keep))
        counts["rewritten"] += 1
    return counts


def write_metadata(storage: Storage, latest_ok: pa.Table) -> Optional[str]:
    """images/metadata.parquet for `--output-format files`: `file_name` (relative to images/)
    and the SAMPLE_COLUMNS of every prompt's latest ok row."""
    keys = latest_ok["image_key"].to_pylist()
    rows = latest_ok.select([c for c in SAMPLE_COLUMNS if c in latest_ok.column_names])
    names = [k[len("images/"):] if k and k.startswith("images/") else None for k in keys]
    mask = pa.array([n is not None for n in names], pa.bool_())  # typed: empty when no row is ok
    table = rows.add_column(0, "file_name", pa.array(names, pa.string())).filter(mask)
    if table.num_rows == 0:
        return None
    return storage.write_parquet(METADATA_KEY, table)


def finish_outputs(storage: Storage, fmt: str, telemetry: Optional[pa.Table]) -> dict[str, int]:
    """The end-of-run step for `fmt`, from the whole job's telemetry (every run)."""
    from pipeline.ledger import latest_per_prompt

    if telemetry is None or telemetry.num_rows == 0:
        return {}
    latest = latest_per_prompt(telemetry)
    ok = latest.filter(pc.equal(latest["status"], "ok"))
    if fmt == "files":
        write_metadata(storage, ok)
        return {"metadata_rows": ok.num_rows}
    return finalize(storage, fmt, ok)
