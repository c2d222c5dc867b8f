"""The engine as a Ray Data processor (pipeline.processor) through a real local Ray: prompts
Parquet -> ray.data.read_parquet -> processor -> write_parquet -> Hugging Face `datasets`
loads the images and captions; per-row failures are rows; the images equal the worker's."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.worker import GeneratorWorker

from pipeline.config import ConfigError, build_config
from pipeline.processor import OUTPUT_SCHEMA, build_processor, prompt_id_of, with_prompt_ids

CONFIG = {"job_id": "proc", "bundle": "random:0", "device": "cpu", "num_actors": 1, "cpus_per_actor": 1.0,
          "max_prompt_chars": 40, "decode": {"method": "ar", "temperature": 0.0, "batch_size": 2}}
PROMPTS = [{"prompt_id": "a", "prompt": "a smiling face", "seed": 1},
           {"prompt_id": "b", "prompt": "a red heart", "seed": 2},
           {"prompt_id": "c", "prompt": "x" * 41, "seed": 3},  # too long: a failed row, not an error
           {"prompt_id": None, "prompt": "a cat", "seed": 4}]  # no id: one from prompt + seed


@pytest.fixture(scope="module")
def ray_local(ray_session):
    return ray_session


def test_prompts_to_a_dataset_that_datasets_loads(tmp_path, ray_local):
    import ray

    src = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(PROMPTS), src)
    processor = build_processor({**CONFIG, "output": str(tmp_path / "shared")})
    # the user's pipeline (docs/pipeline.md, "The engine as a Ray Data processor")
    ds = processor(ray.data.read_parquet(str(src)))
    ds.write_parquet(str(tmp_path / "out"))

    datasets = pytest.importorskip("datasets")
    hf = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "*.parquet"), split="train")
    rows = {r["prompt_id"]: r for r in hf}
    cat = prompt_id_of("a cat", 4)
    assert set(rows) == {"a", "b", "c", cat}
    for pid in ("a", "b", cat):
        r = rows[pid]
        assert r["status"] == "ok" and r["error"] is None
        assert isinstance(r["image"], Image.Image) and r["image"].size == (r["width"], r["height"])  # decoded by datasets
        assert len(r["tokens"]) == r["grid_h"] * r["grid_w"]
    assert rows["a"]["prompt"] == "a smiling face" and rows[cat]["prompt"] == "a cat"  # the captions
    assert rows["c"]["status"] == "failed" and "max_prompt_chars" in rows["c"]["error"] and rows["c"]["image"] is None
    assert not (tmp_path / "shared" / "images").exists()  # images are columns, not side-effect writes

    # the same images and token grids as the worker writes for jobs.generate
    written = pq.read_table(str(tmp_path / "out"))
    assert written.schema.names == OUTPUT_SCHEMA.names
    got = {r["prompt_id"]: r for r in written.to_pylist()}
    worker = GeneratorWorker(build_config({**CONFIG, "output": str(tmp_path / "files")}).model_dump(mode="json"))
    for r in worker.run(pa.Table.from_pylist(PROMPTS[:2])).to_pylist():
        stored = Image.open(tmp_path / "files" / r["image_key"])
        assert got[r["prompt_id"]]["tokens"] == r["tokens"]
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(got[r["prompt_id"]]["image"]["bytes"]))), np.asarray(stored))


def test_ids_are_made_only_where_missing():
    t = with_prompt_ids(pa.Table.from_pylist([{"prompt": "x", "seed": 1, "prompt_id": "keep"},
                                              {"prompt": "x", "seed": 1, "prompt_id": None}]))
    assert t["prompt_id"].to_pylist() == ["keep", prompt_id_of("x", 1)]
    assert with_prompt_ids(pa.table({"prompt": ["y"]}))["prompt_id"].to_pylist() == [prompt_id_of("y", None)]


def test_a_bad_config_fails_when_the_processor_is_built():
    with pytest.raises(ConfigError, match="decode.batch_size"):
        build_processor({"decode": {"batch_size": 0}})


def test_the_documented_pipeline_names_real_fields():
    """docs/pipeline.md's user pipeline: valid Python, and its config validates (every field exists)."""
    import ast
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    section = doc[doc.index("## The engine as a Ray Data processor"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "build_processor")
    config = ast.literal_eval(call.args[0])
    assert build_config(config).decode.method == "adt" and len(code.strip().splitlines()) <= 10
    assert "processor(ds)" in code and "write_parquet" in code
