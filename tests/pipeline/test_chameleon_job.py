"""`python -m jobs.generate` on a tiny random Chameleon-family bundle saved in the real on-disk
layouts (HF target directory + tokenizer.json, LANTERN drafter directory with its neighbour table,
Meta's vqgan.yaml + vqgan.ckpt, bundle.json naming the family), through the session's local Ray:
to a local folder and to S3 (moto's server on loopback). A checkpoint directory with a missing
shard or a wrong-shaped tensor, and a device too small for one image, exit 2 before Ray starts
with one line naming the cause."""

import io
import json
import shutil
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "adt_core"))  # chameleon_fixtures

from chameleon_fixtures import make_drafter, make_hf_chameleon, make_tokenizer, make_vqgan  # noqa: E402
from adt_core.bundles.family_bundle import write_family_bundle  # noqa: E402
from pipeline.config import StorageSettings  # noqa: E402
from pipeline.storage import open_storage  # noqa: E402
from pipeline_helpers import simple_rows, write_prompts  # noqa: E402

WIDTH, HEIGHT = 64, 48  # Lumina layout: 3 x 4 codes, an end-of-line after every image row
PIXELS = (4 * 2, 3 * 2)  # the tiny VQGAN upsamples 2x (the real one 16x: 64 x 48 px)
EAGLE = ["--decode.method", "eagle2", "--decode.temperature", "0", "--decode.tree.depth", "2",
         "--decode.tree.top-k", "2", "--decode.tree.budget", "4", "--decode.batch-size", "3"]  # a short cost table


def write_neighbours(path: Path, codes: int = 8192, k: int = 8) -> None:
    """A narrow LANTERN-style table (uint16, row = code, never the code itself)."""
    table = (np.arange(codes)[:, None] + 1 + np.arange(k)[None]) % codes
    np.save(path, table.astype(np.uint16))


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lumina_bundle")
    make_hf_chameleon(root / "target", seed=0, qk_groups=1, shard_size="200KB")  # several shards
    make_tokenizer(root / "target" / "tokenizer.json")
    make_vqgan(root / "vq", n_embed=8192, attn_type=None)
    make_drafter(root / "drafter", root / "target", qk_groups=1)
    write_neighbours(root / "drafter" / "top_8191_indices.npy")
    write_family_bundle(root, "tiny-lumina", "chameleon", {"target": "target", "drafter": "drafter", "vq": "vq"},
                        {"layout": "lumina", "width": WIDTH, "height": HEIGHT, "check_size": False})
    return root


def generate(*argv: str) -> tuple[int, str, str]:
    from jobs.generate import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["--no-progress", *argv])
    return code, out.getvalue(), err.getvalue()


def test_local_then_s3_output(lumina_dir, tmp_path, ray_session, s3):
    rows = simple_rows(3)
    src = write_prompts(tmp_path / "prompts.parquet", rows)
    code, out, err = generate("--bundle", str(lumina_dir), "--input", str(src), "--output", str(tmp_path / "out"),
                              "--job-id", "lumina", *EAGLE)
    assert code == 0, err + out
    plan_line = next(line for line in out.splitlines() if "memory plan:" in line)
    assert "image(s) in flight" in plan_line and "1 rows x" in plan_line  # cfg 1: the bundle's default
    plan = json.loads((tmp_path / "out" / "memory_plan.json").read_text())
    assert plan["images"] == 3 and plan["fits"] >= 3 and plan["weights"]["target"] > 0  # decode.batch_size caps it
    images = sorted((tmp_path / "out" / "images").glob("*.png"))
    assert len(images) == 3
    assert all(Image.open(p).size == PIXELS for p in images)  # W x H codes of the requested size
    tel = pa.parquet.read_table(str(tmp_path / "out" / "telemetry")).to_pylist()
    assert {r["status"] for r in tel} == {"ok"} and {r["bundle"] for r in tel} == {"tiny-lumina"}

    # a device that holds two images: the plan, not decode.batch_size (64), sets what is in flight
    from adt_core import DecodeConfig, load_bundle
    from adt_core.memory import bundle_plan

    probe = bundle_plan(load_bundle(lumina_dir), DecodeConfig(method="ar", cfg_scale=3.0), 10**12)
    device_gb = (probe.weights_total + probe.workspace_bytes + 2.5 * probe.per_image) / 0.92 / 1e9
    settings = StorageSettings(endpoint_url=s3.endpoint)
    open_storage(f"s3://{s3.bucket}/prompts", settings).write_parquet("p.parquet", pa.Table.from_pylist(rows))
    code, out, err = generate("--bundle", str(lumina_dir), "--input", f"s3://{s3.bucket}/prompts",
                              "--output", f"s3://{s3.bucket}/runs/lumina", "--storage.endpoint-url", s3.endpoint,
                              "--decode.method", "ar", "--decode.temperature", "0", "--decode.cfg-scale", "3.0",
                              "--device-memory-gb", f"{device_gb:.9f}")
    assert code == 0, err + out
    store = open_storage(f"s3://{s3.bucket}/runs/lumina", settings)
    keys = set(store.list_keys())
    assert {"job.json", "summary.json", "memory_plan.json"} <= keys
    plan = json.loads(store.get_text("memory_plan.json"))
    assert (plan["images"], plan["batch_size"], plan["rows_per_image"]) == (2, 64, 2)  # CFG 3: two rows
    assert "2 in flight per actor" in out and "(cpu, 2 in flight)" in out + err
    s3_images = sorted(k for k in keys if k.startswith("images/") and k.endswith(".png"))
    assert len(s3_images) == 3
    # greedy: the same prompts give the same images whatever the method and the batch (cfg differs
    # here, so only shapes are compared)
    img = Image.open(io.BytesIO(store.get_bytes(s3_images[0])))
    assert img.size == PIXELS


def _broken_copy(lumina_dir: Path, dest: Path) -> Path:
    shutil.copytree(lumina_dir, dest)
    return dest


@pytest.mark.parametrize("header_only", [False, True])
def test_broken_checkpoint_exits_2_naming_it(lumina_dir, tmp_path, monkeypatch, header_only):
    """A missing shard and a wrong-shaped tensor: exit 2 and one line naming it, before Ray (the
    driver loads a small bundle whole; a big one on the meta device, headers only)."""
    from safetensors.torch import load_file, save_file

    import pipeline.checks

    if header_only:
        monkeypatch.setattr(pipeline.checks, "FULL_LOAD_BYTES", 0)
    src = write_prompts(tmp_path / "prompts.parquet", simple_rows(1))
    missing = _broken_copy(lumina_dir, tmp_path / "missing")
    index = json.loads((missing / "target" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = sorted(set(index.values()))[-1]
    (missing / "target" / shard).unlink()
    code, out, err = generate("--bundle", str(missing), "--input", str(src), "--output", str(tmp_path / "o1"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"missing shard {shard}" in err and not (tmp_path / "o1").exists()

    wrong = _broken_copy(lumina_dir, tmp_path / "wrong")
    key = "model.layers.1.mlp.down_proj.weight"
    path = wrong / "target" / index[key]
    state = load_file(str(path))
    state[key] = state[key][:, :-1].contiguous()
    save_file(state, str(path), metadata={"format": "pt"})
    code, out, err = generate("--bundle", str(wrong), "--input", str(src), "--output", str(tmp_path / "o2"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"misshaped keys: {key}" in err and not (tmp_path / "o2").exists()


def test_a_device_too_small_for_one_image_exits_2(lumina_dir, tmp_path):
    src = write_prompts(tmp_path / "prompts.parquet", simple_rows(1))
    code, out, err = generate("--bundle", str(lumina_dir), "--input", str(src), "--output", str(tmp_path / "o"),
                              "--device-memory-gb", "0.001")
    assert code == 2 and "not one image fits: the 0.0 GB device" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_an_actors_memory_plan_error_is_a_refusal():
    """When only the actors know their device (a remote GPU cluster), a plan without one image
    comes back from Ray as the pool's failure: the driver turns it into exit 2 (checked by hand
    through Ray: `error: an actor's memory plan: not one image fits: ...`, exit code 2)."""
    from adt_core.memory import MemoryPlanError
    from pipeline.execute import memory_refusal

    try:
        try:
            raise MemoryPlanError("not one image fits: the 8.0 GB device leaves 0.00 GB")
        except MemoryPlanError as inner:
            raise RuntimeError("actor died") from inner
    except RuntimeError as wrapped:
        assert str(memory_refusal(wrapped)) == "an actor's memory plan: not one image fits: the 8.0 GB device leaves 0.00 GB"
    text = RuntimeError("Traceback ...\nadt_core.memory.MemoryPlanError: not one image fits: x\n(more)")
    assert str(memory_refusal(text)) == "an actor's memory plan: not one image fits: x"
    assert memory_refusal(RuntimeError("something else")) is None


def test_a_bundle_without_a_drafter_refuses_speculative_methods(lumina_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(lumina_dir, bare, ignore=shutil.ignore_patterns("drafter"))
    meta = json.loads((bare / "bundle.json").read_text())
    meta["components"]["drafter"] = None
    (bare / "bundle.json").write_text(json.dumps(meta))
    src = write_prompts(tmp_path / "prompts.parquet", simple_rows(1))
    code, out, err = generate("--bundle", str(bare), "--input", str(src), "--output", str(tmp_path / "o"), *EAGLE)
    assert code == 2 and "decode.method 'eagle2' needs a drafter" in err and len(err.strip().splitlines()) == 1
