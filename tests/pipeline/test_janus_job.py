"""`jobs.generate` end to end on a tiny Janus-Pro bundle (a family bundle directory: the published
checkpoint layout as target, VQ and tokenizer, a Janus drafter directory), through the session's
local Ray, local output: the images, token grids and telemetry are the engine's, and the job's
tokens equal the engine's `ar` tokens (coupled sampling at Janus' defaults: T 1, CFG 5)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adt_core"))
from janus_fixtures import GRID, make_hf_janus, make_tokenizer, save_published  # noqa: E402
from pipeline_helpers import write_prompts  # noqa: E402

N = 6


@pytest.fixture(scope="module")
def janus_bundle(tmp_path_factory) -> Path:
    pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")
    from adt_core.bundles.family_bundle import write_family_bundle
    from adt_core.config import SamplingConfig
    from adt_core.families.janus.drafter import new_drafter, save_janus_drafter
    from adt_core.families.janus.prompt import JANUS_SAMPLING
    from adt_core.families.janus.weights import load_janus

    root = tmp_path_factory.mktemp("janus_bundle")
    save_published(make_hf_janus(seed=2), root / "target")
    make_tokenizer(root / "target" / "tokenizer.json")
    save_janus_drafter(new_drafter(load_janus(root / "target"), seed=0), root / "drafter")
    comps = {"target": "target", "vq": "target", "tokenizer": "target", "drafter": "drafter"}
    return write_family_bundle(root, "tiny-janus", "janus", comps, {"grid": GRID}, SamplingConfig(**JANUS_SAMPLING))


def test_generate_job_on_a_janus_bundle(janus_bundle, tmp_path, ray_session, capsys):
    from adt_core import DecodeConfig, Generator, load_bundle
    from jobs.generate import main

    rows = [{"prompt_id": f"j{i}", "prompt": "a cat " * (1 + i % 3) + str(i), "seed": i} for i in range(N)]
    src = write_prompts(tmp_path / "p.parquet", rows)
    out = tmp_path / "out"
    code = main(["--job-id", "janus", "--bundle", str(janus_bundle), "--input", str(src), "--output", str(out),
                 "--num-actors", "1", "--batch-size", str(N), "--decode.method", "eagle2",
                 "--decode.batch-size", "3"])
    assert code == 0, capsys.readouterr()
    tele = pq.read_table(out / "telemetry").to_pylist()
    assert sorted(r["prompt_id"] for r in tele) == [r["prompt_id"] for r in rows]
    assert all(r["status"] == "ok" and r["method"] == "eagle2" and (r["grid_h"], r["grid_w"]) == (GRID, GRID)
               for r in tele)
    bundle = load_bundle(janus_bundle)
    ref = Generator(bundle, DecodeConfig(method="ar", batch_size=3)).generate([r["prompt"] for r in rows],
                                                                               [r["seed"] for r in rows])
    by_id = {r["prompt_id"]: r for r in tele}
    f = bundle.vq.downsample_factor
    for row, res in zip(rows, ref):
        assert by_id[row["prompt_id"]]["tokens"] == res.tokens.flatten().tolist()
    images = sorted(p for p in out.rglob("*.png"))
    assert len(images) == N
    assert all(Image.open(p).size == (GRID * f, GRID * f) for p in images)
    job = json.loads((out / "job.json").read_text())
    assert job["bundle"] == str(janus_bundle)


def test_jacobi_job_on_a_janus_bundle_without_a_drafter(janus_bundle, tmp_path, ray_session, capsys):
    """No drafter in the bundle: `--decode.method jacobi` runs (its drafts are the target's own
    earlier predictions) and every image's tokens equal the engine's `ar` tokens."""
    from adt_core import DecodeConfig, Generator, load_bundle
    from adt_core.bundles.family_bundle import write_family_bundle
    from adt_core.families.janus.prompt import JANUS_SAMPLING
    from adt_core.config import SamplingConfig
    from jobs.generate import main

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "target").symlink_to(janus_bundle / "target", target_is_directory=True)
    comps = {"target": "target", "vq": "target", "tokenizer": "target"}
    write_family_bundle(plain, "tiny-janus-plain", "janus", comps, {"grid": GRID}, SamplingConfig(**JANUS_SAMPLING))
    rows = [{"prompt_id": f"p{i}", "prompt": "a dog " * (1 + i % 2) + str(i), "seed": 10 + i} for i in range(4)]
    src = write_prompts(tmp_path / "p.parquet", rows)
    out = tmp_path / "out"
    code = main(["--job-id", "janus-jacobi", "--bundle", str(plain), "--input", str(src), "--output", str(out),
                 "--num-actors", "1", "--batch-size", "4", "--decode.method", "jacobi", "--decode.batch-size", "2"])
    assert code == 0, capsys.readouterr()
    tele = {r["prompt_id"]: r for r in pq.read_table(out / "telemetry").to_pylist()}
    assert all(r["status"] == "ok" and r["method"] == "jacobi" for r in tele.values())
    bundle = load_bundle(plain)
    assert bundle.drafter is None
    ref = Generator(bundle, DecodeConfig(method="ar", batch_size=2)).generate([r["prompt"] for r in rows],
                                                                               [r["seed"] for r in rows])
    for row, res in zip(rows, ref):
        assert tele[row["prompt_id"]]["tokens"] == res.tokens.flatten().tolist()
    assert sum(r["num_accepted_draft_tokens"] for r in tele.values()) > 0
    from jobs.report import main as report_main

    assert report_main([str(out), "--out", str(tmp_path / "rep")]) == 0  # the report names it, maps its rounds
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "jacobi" in md and (tmp_path / "rep" / "report_tree_maps.png").exists()
