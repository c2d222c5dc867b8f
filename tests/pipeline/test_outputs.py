"""Outputs as datasets: webdataset and parquet shards, images/metadata.parquet for imagefolder.

Shards are read back with Python's tarfile and with Ray Data's read_webdataset; every prompt
id appears once, after a resume and after a run whose last rows never became durable. Every
output format loads with HF `datasets` (files as imagefolder, webdataset, parquet) into
images and captions."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import build_config
from pipeline.driver import run_job
from pipeline.exit_codes import EXIT_OK
from pipeline.shards import Sample, finalize, sample_key, shard_key, shard_sample_keys, write_shards
from pipeline.storage import open_storage
from pipeline_helpers import simple_rows, write_prompts

FAST = {"method": "ar", "temperature": 0.0}


def job(tmp_path, src, **over):
    data = {"job_id": "ds", "bundle": "random:0", "input": str(src), "output": str(tmp_path / "out"), "num_actors": 1,
            "batch_size": 3, "decode": FAST, "progress": False}
    data.update(over)
    return build_config(data)


def tar_ids(out_dir) -> Counter:
    ids = Counter()
    for shard in sorted((out_dir / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            names = tar.getnames()
            for m in tar.getmembers():
                if m.name.endswith(".json"):
                    row = json.loads(tar.extractfile(m).read())
                    key = m.name[: -len(".json")]
                    assert {f"{key}.png", f"{key}.txt"} <= set(names)
                    assert tar.extractfile(f"{key}.txt").read().decode() == row["prompt"]
                    Image.open(io.BytesIO(tar.extractfile(f"{key}.png").read())).verify()
                    ids[row["prompt_id"]] += 1
    return ids


def load_with_datasets(tmp_path, monkeypatch, builder: str, **kw):
    """`datasets.load_dataset(builder, ...)`, offline, its cache under tmp_path."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return datasets.load_dataset(builder, split="train", cache_dir=str(tmp_path / "hf-cache"), **kw)


def test_sample_keys_have_no_dots_and_stay_distinct():
    assert sample_key("p001") == "p001"
    keys = {sample_key(i) for i in ("a.b", "a_b", "A", "a/b", "x.png")}
    assert len(keys) == 5 and not any("." in k for k in keys)


def test_finalize_keeps_each_sample_in_the_shard_its_row_names(tmp_path):
    store = open_storage(str(tmp_path))

    def samples(ids):
        return [Sample(sample_key(i), b"png-" + i.encode(), {"prompt_id": i, "prompt": f"cap {i}"}) for i in ids]

    (first, _), = write_shards(store, "webdataset", samples(["a", "b", "c"]), None)
    (orphan, _), = write_shards(store, "webdataset", samples(["d"]), None)  # its rows never became durable
    (second, _), = write_shards(store, "webdataset", samples(["b", "c", "d"]), None)  # the resume redid b, c, d
    assert first == shard_key("webdataset", ["a", "b", "c"])  # a pure function of the keys
    latest = pa.table({"prompt_id": ["a", "b", "c", "d"], "image_key": [first, second, second, second]})
    counts = finalize(store, "webdataset", latest)
    assert counts == {"shards": 2, "rewritten": 1, "deleted": 1}
    assert shard_sample_keys("webdataset", store.get_bytes(first)) == ["a"]
    assert not store.exists(orphan)
    assert finalize(store, "webdataset", latest) == {"shards": 2, "rewritten": 0, "deleted": 0}  # idempotent


def test_webdataset_shards_read_back_once_after_resume_and_lost_rows(tmp_path, ray_session, monkeypatch):
    rows = simple_rows(10) + [{"prompt_id": "dotted.id", "prompt": "a dotted face", "seed": 3}]
    src = write_prompts(tmp_path / "prompts.parquet", rows)
    out = tmp_path / "out"
    first = run_job(job(tmp_path, src, output_format="webdataset", limit=6), stream=io.StringIO())
    assert first.exit_code == EXIT_OK
    assert tar_ids(out) == Counter(r["prompt_id"] for r in rows[:6])
    # A driver killed after a worker wrote its shard but before the rows were durable: drop
    # one telemetry part's worth of rows (the shard stays behind, orphaned).
    tel = pq.read_table(str(out / "telemetry"))
    for f in (out / "telemetry").glob("*.parquet"):
        f.unlink()
    kept = tel.filter(pa.compute.is_in(tel["prompt_id"], value_set=pa.array(["p000", "p001", "p002"])))
    pq.write_table(kept, out / "telemetry" / "run-old_c0_0.parquet")
    res = run_job(job(tmp_path, src, output_format="webdataset", resume=True), stream=io.StringIO())
    assert res.exit_code == EXIT_OK and res.summary["ok"] == 8
    assert tar_ids(out) == Counter(r["prompt_id"] for r in rows)  # every id exactly once

    import ray

    ds = ray.data.read_webdataset(str(out / "shards"))
    got = ds.take_all()
    metas = [json.loads(r["json"]) if isinstance(r["json"], (bytes, str)) else r["json"] for r in got]
    assert Counter(m["prompt_id"] for m in metas) == Counter(r["prompt_id"] for r in rows)
    assert all(r["png"] is not None for r in got)

    from datasets import Image as ImageFeature

    hf = load_with_datasets(tmp_path, monkeypatch, "webdataset", data_files=sorted(map(str, (out / "shards").glob("*.tar"))))
    assert isinstance(hf.features["png"], ImageFeature) and sorted(hf["txt"]) == sorted(r["prompt"] for r in rows)
    first = hf[0]
    assert first["png"].size == (first["json"]["width"], first["json"]["height"])
    assert first["json"]["prompt"] == first["txt"] and first["__key__"] == sample_key(first["json"]["prompt_id"])


def test_parquet_shards_carry_hf_images_and_load_with_datasets(tmp_path, ray_session, monkeypatch):
    from datasets import Image as ImageFeature

    src = write_prompts(tmp_path / "prompts.parquet", simple_rows(5))
    res = run_job(job(tmp_path, src, output_format="parquet", shard_size=2), stream=io.StringIO())
    assert res.exit_code == EXIT_OK
    shards = tmp_path / "out" / "shards"
    table = pq.read_table(str(shards))
    assert sorted(table["prompt_id"].to_pylist()) == [f"p{i:03d}" for i in range(5)]
    row = table.to_pylist()[0]
    assert row["image"]["path"] == f"{row['key']}.png"
    img = Image.open(io.BytesIO(row["image"]["bytes"]))
    assert img.size == (row["width"], row["height"]) and row["prompt"].startswith("a smiling face")
    assert all(n.endswith(".parquet") and "-n" in n for n in (p.name for p in shards.iterdir()))
    assert max(int(p.name.rsplit("-n", 1)[1].split(".")[0]) for p in shards.iterdir()) <= 2
    ds = load_with_datasets(tmp_path, monkeypatch, "parquet", data_dir=str(shards))
    assert isinstance(ds.features["image"], ImageFeature)  # no cast_column needed
    assert sorted(ds["prompt_id"]) == [f"p{i:03d}" for i in range(5)]
    first = ds[0]
    assert first["image"].size == (first["width"], first["height"]) and first["prompt"].startswith("a smiling face")
    from jobs.report_data import image_png  # the report reads the image back out of its shard

    tel = pq.read_table(str(tmp_path / "out" / "telemetry")).to_pylist()[0]
    assert Image.open(io.BytesIO(image_png(open_storage(str(tmp_path / "out")), tel))).size == (tel["width"], tel["height"])


def test_parquet_features_match_what_datasets_infers_and_survive_finalize(tmp_path):
    datasets = pytest.importorskip("datasets")
    from pipeline.shards import PARQUET_SCHEMA, hf_features

    inferred = datasets.Features.from_arrow_schema(PARQUET_SCHEMA.remove_metadata()).to_dict()
    inferred["image"] = {"_type": "Image"}
    assert hf_features(PARQUET_SCHEMA) == inferred
    store = open_storage(str(tmp_path))
    samples = [Sample(sample_key(i), b"png-" + i.encode(), {"prompt_id": i, "prompt": f"cap {i}"}) for i in "abc"]
    (key, _), = write_shards(store, "parquet", samples, None)
    finalize(store, "parquet", pa.table({"prompt_id": ["a"], "image_key": [key]}))  # rewrites the shard: a only
    kept = pq.read_table(io.BytesIO(store.get_bytes(key)))
    assert kept["key"].to_pylist() == ["a"] and kept.schema.metadata[b"huggingface"] == PARQUET_SCHEMA.metadata[b"huggingface"]


def test_files_layout_loads_with_datasets_imagefolder(tmp_path, ray_session, monkeypatch):
    """--output-format files: the images/ folder is an imagefolder dataset (metadata.parquet)."""
    rows = simple_rows(4)
    src = write_prompts(tmp_path / "prompts.parquet", rows)
    res = run_job(job(tmp_path, src), stream=io.StringIO())
    assert res.exit_code == EXIT_OK
    meta = pq.read_table(str(tmp_path / "out" / "images" / "metadata.parquet"))
    assert meta.column_names[0] == "file_name" and meta.num_rows == 4
    ds = load_with_datasets(tmp_path, monkeypatch, "imagefolder", data_dir=str(tmp_path / "out" / "images"))
    assert sorted(ds["prompt"]) == sorted(r["prompt"] for r in rows)
    first = ds[0]
    assert first["image"].size == (first["width"], first["height"])
    assert first["generation_time_ms"] > 0 and first["method"] == "ar"


def test_files_metadata_when_no_prompt_is_ok(tmp_path):
    """Every row failed (e.g. the store refused every image): no metadata file, no crash."""
    from pipeline.shards import finish_outputs
    from pipeline.storage import open_storage
    from pipeline.telemetry import SCHEMA

    rows = [dict.fromkeys(SCHEMA.names) | {"prompt_id": f"p{i}", "status": "failed", "error": "x"} for i in range(3)]
    store = open_storage(str(tmp_path / "out"))
    assert finish_outputs(store, "files", pa.Table.from_pylist(rows, schema=SCHEMA)) == {"metadata_rows": 0}
    assert not store.exists("images/metadata.parquet")
