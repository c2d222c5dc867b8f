"""Bundle manifests: tiny checkpoints in the published layouts, local or in S3 (moto's server on
loopback), loaded through `adt_core.load_bundle(manifest)` and decoded by `Generator`; the
download cache, sha256 refusal, manifest errors and memory planning."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import adt_core
from adt_core import DecodeConfig, Generator, TreeConfig
from adt_core.bundles.bundle import resolve_bundle_dir
from adt_core.bundles.bundle import Bundle
from adt_core.bundles.cache import LocalCache
from adt_core.bundles.manifest import load_manifest_bundle, read_manifest
from adt_core.bundles.sources import ChecksumError, ManifestError, sha256_file
from adt_core.config import SamplingConfig
from adt_core.round.plan import ROOM
from adt_core.families.llamagen import weights as llamagen_checkpoints
from adt_core.families.llamagen.drafter import DrafterConfig
from adt_core.families.llamagen.drafter import Drafter
from adt_core.families.llamagen.model import GPTConfig
from adt_core.families.llamagen.model import LlamaGenGPT
from adt_core.families.llamagen.t5 import T5TextEncoder
from adt_core.families.llamagen.text_encoder import HashTextEncoder
from adt_core.families.vqgan import VQModel
from adt_core.families.vqgan import VQConfig
from adt_core.memory import GB, bundle_plan
from test_checkpoints import (
    same_weights, tiny_drafter, tiny_gpt, tiny_vq, write_lantern_drafter, write_llamagen_hf, write_llamagen_pt,
    write_vq_pt,
)
from test_t5 import write_tiny_t5

PROMPTS = ["a red cat sitting on the table", "blue sun over green hills"]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """One tiny model family written in every published layout (caption 8 x 16, grid 4 x 4)."""
    d = tmp_path_factory.mktemp("published")
    gpt, drafter, vq = tiny_gpt(), tiny_drafter(), tiny_vq()
    write_llamagen_pt(gpt, d / "t2i_XL_stage1_256.pt")
    write_llamagen_hf(gpt, d / "LlamaGen-T2I")
    write_lantern_drafter(drafter, d / "llamagen_drafter")
    write_vq_pt(vq, d / "vq_ds16_t2i.pt")
    write_tiny_t5(d / "flan-t5-xl")
    return SimpleNamespace(root=d, gpt=gpt, drafter=drafter, vq=vq)


def manifest_dict(target="t2i_XL_stage1_256.pt", root: str = "", **extra) -> dict:
    j = (lambda p: f"{root}/{p}") if root else (lambda p: p)
    m = {
        "name": "tiny-llamagen",
        "grid": 4,
        "target": {"path": j(target), "n_head": 4},
        "drafter": {"path": j("llamagen_drafter")},
        "vq": j("vq_ds16_t2i.pt"),
        "text_encoder": {"type": "t5", "path": j("flan-t5-xl"), "dtype": "float32", "device": "cpu"},
        "sampling": {"temperature": 1.0, "top_k": 0, "cfg_scale": 4.0},
    }
    m.update(extra)
    return m


def write_manifest(path: Path, m: dict) -> Path:
    path.write_text(json.dumps(m, indent=2) if path.suffix == ".json" else yaml.safe_dump(m, sort_keys=False))
    return path


# ---- local manifests -> Generator -----------------------------------------------------------
@pytest.mark.parametrize("fmt,target", [("yaml", "t2i_XL_stage1_256.pt"), ("json", "LlamaGen-T2I")])
def test_manifest_bundle_greedy_speculative_equals_vanilla(published, fmt, target):
    path = write_manifest(published.root / f"tiny_{target.split('.')[0]}.{fmt}", manifest_dict(target))
    assert resolve_bundle_dir(path) == path  # what the driver checks up front
    bundle = adt_core.load_bundle(path)
    assert bundle.name == "tiny-llamagen" and bundle.grid == (4, 4)
    assert isinstance(bundle.text_encoder, T5TextEncoder)
    assert same_weights(bundle.target, published.gpt) and same_weights(bundle.drafter, published.drafter)
    assert same_weights(bundle.vq, published.vq)
    assert bundle.sampling.cfg_scale == 4.0 and bundle.sampling.top_k == 0
    runs = {}
    for method in ("ar", "eagle2", "static", "adt"):
        tree = TreeConfig(depth=3, top_k=4, budget=12)
        g = Generator(bundle, DecodeConfig(method=method, temperature=0.0, tree=tree))
        res = g.generate(PROMPTS, [0, 1])
        runs[method] = torch.stack([r.tokens for r in res])
        assert res[0].image.shape == (8, 8, 3)
    for method in ("eagle2", "static", "adt"):
        assert torch.equal(runs[method], runs["ar"]), method


def test_relative_paths_and_variables(published, monkeypatch, tmp_path):
    monkeypatch.setenv("TINY_MODELS", str(published.root))
    m = read_manifest(write_manifest(tmp_path / "m.yaml", manifest_dict(root="${TINY_MODELS}")))
    assert m.target.path == str(published.root / "t2i_XL_stage1_256.pt")
    assert m.text_encoder["path"] == str(published.root / "flan-t5-xl")
    m2 = read_manifest(write_manifest(published.root / "rel.yaml", manifest_dict()))
    assert m2.vq.path == str(published.root / "vq_ds16_t2i.pt")
    assert m2.target.options == {"n_head": 4}


@pytest.mark.parametrize("change,match", [
    ({"grdi": 4}, "unknown fields \\['grdi'\\]"),
    ({"grid": None}, "grid must be"),
    ({"target": {"path": "${NOT_SET_ANYWHERE}/t.pt"}}, "NOT_SET_ANYWHERE not set"),
    ({"target": {"path": "t.pt", "sha256": "abc"}}, "not a 64-digit hex"),
    ({"target": {"path": "t.pt", "heads": 4}}, "target: unknown fields \\['heads'\\]"),
    ({"sampling": {"cfg_scale": 0.5}}, "cfg_scale must be a finite number >= 1"),
    ({"dtype": "int8"}, "dtype must be one of"),
])
def test_manifest_errors_name_the_field(tmp_path, change, match):
    m = manifest_dict()
    m.update(change)
    with pytest.raises(ManifestError, match=match):
        read_manifest(write_manifest(tmp_path / "bad.yaml", m))


def test_missing_fields_and_files_are_named(tmp_path, published):
    m = manifest_dict()
    del m["vq"]
    with pytest.raises(ManifestError, match="missing fields \\['vq'\\]"):
        read_manifest(write_manifest(tmp_path / "m.yaml", m))
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_manifest_bundle(write_manifest(tmp_path / "m2.yaml", manifest_dict(target=str(tmp_path / "nope.pt"))))


def test_local_sha256_is_checked(published, tmp_path):
    good = sha256_file(published.root / "vq_ds16_t2i.pt")
    cache = LocalCache(tmp_path / "cache")
    assert cache.fetch(str(published.root / "vq_ds16_t2i.pt"), good) == published.root / "vq_ds16_t2i.pt"
    with pytest.raises(ChecksumError, match="does not match"):
        cache.fetch(str(published.root / "vq_ds16_t2i.pt"), "0" * 64)


# ---- S3 (moto's server on 127.0.0.1) ----------------------------------------------------------


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    import boto3

    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",
           "AWS_ENDPOINT_URL": moto_endpoint}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = "models-" + uuid.uuid4().hex[:10]
    client.create_bucket(Bucket=bucket)
    return SimpleNamespace(client=client, bucket=bucket)


def upload_tree(client, bucket: str, root: Path, names: list[str], prefix: str = "llamagen") -> None:
    for name in names:
        p = root / name
        files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
        for f in files:
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(root).as_posix()}")


def count_downloads(monkeypatch) -> list[str]:
    seen: list[str] = []
    original = LocalCache._download

    def spy(self, bucket, key, head, sha256):
        seen.append(key)
        return original(self, bucket, key, head, sha256)

    monkeypatch.setattr(LocalCache, "_download", spy)
    return seen


def test_s3_manifest_downloads_once_and_reuses_the_cache(published, s3, tmp_path, monkeypatch):
    names = ["t2i_XL_stage1_256.pt", "llamagen_drafter", "vq_ds16_t2i.pt", "flan-t5-xl"]
    upload_tree(s3.client, s3.bucket, published.root, names)
    root = f"s3://{s3.bucket}/llamagen"
    bin_sha = sha256_file(published.root / "llamagen_drafter" / "pytorch_model.bin")
    m = manifest_dict(root=root, cache_dir="cache")
    m["target"]["sha256"] = sha256_file(published.root / "t2i_XL_stage1_256.pt")
    m["drafter"] = {"path": f"{root}/llamagen_drafter/",
                    "sha256": {"pytorch_model.bin": bin_sha}}
    path = write_manifest(tmp_path / "s3.yaml", m)
    seen = count_downloads(monkeypatch)

    first = adt_core.load_bundle(path)
    n_t5 = sum(1 for f in (published.root / "flan-t5-xl").rglob("*") if f.is_file())
    assert len(seen) == 1 + 2 + 1 + n_t5
    cached = tmp_path / "cache" / "s3" / s3.bucket / "llamagen"
    assert (cached / "t2i_XL_stage1_256.pt").is_file() and (cached / "llamagen_drafter" / "config.json").is_file()
    assert not list(cached.rglob("*.partial"))
    assert same_weights(first.target, published.gpt) and same_weights(first.drafter, published.drafter)

    # Second load: nothing is downloaded, and the bucket is not even needed any more.
    for page in s3.client.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket):
        for o in page.get("Contents", []):
            s3.client.delete_object(Bucket=s3.bucket, Key=o["Key"])
    again = adt_core.load_bundle(path)
    assert len(seen) == 1 + 2 + 1 + n_t5
    assert same_weights(again.target, first.target) and same_weights(again.vq, first.vq)
    emb1, _ = first.text_encoder.encode(PROMPTS)
    emb2, _ = again.text_encoder.encode(PROMPTS)
    assert torch.equal(emb1, emb2)


def test_s3_wrong_sha256_is_refused_and_not_cached(published, s3, tmp_path, monkeypatch):
    upload_tree(s3.client, s3.bucket, published.root, ["vq_ds16_t2i.pt"])
    cache = LocalCache(tmp_path / "cache")
    url = f"s3://{s3.bucket}/llamagen/vq_ds16_t2i.pt"
    with pytest.raises(ChecksumError, match="does not match the manifest's 0000"):
        cache.fetch(url, "0" * 64)
    local = tmp_path / "cache" / "s3" / s3.bucket / "llamagen" / "vq_ds16_t2i.pt"
    assert not local.exists() and not local.with_name(local.name + ".partial").exists()
    # the right checksum downloads it; a later wrong one is refused even though it is cached
    good = sha256_file(published.root / "vq_ds16_t2i.pt")
    assert cache.fetch(url, good) == local
    seen = count_downloads(monkeypatch)
    with pytest.raises(ChecksumError):
        cache.fetch(url, "f" * 64)
    assert seen == ["llamagen/vq_ds16_t2i.pt"]  # the cached copy did not match: fetched again, refused


def test_s3_missing_object_is_named(s3, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"s3://{s3.bucket}/nothing/here"):
        LocalCache(tmp_path / "c").fetch(f"s3://{s3.bucket}/nothing/here.pt")


# ---- memory planning ---------------------------------------------------------------------
def test_memory_plan_of_llamagen_xl_512():
    """adt_core.memory.bundle_plan on LlamaGen-XL's real shapes (meta device: no weights)."""
    xl = GPTConfig.llamagen("XL", grid=32)
    text = HashTextEncoder(dim=xl.caption_dim, max_tokens=xl.cls_token_num)
    with torch.device("meta"):
        bundle = Bundle("xl", text, LlamaGenGPT(xl), Drafter(DrafterConfig.for_target(xl)), VQModel(VQConfig.vq16()),
                        (32, 32), SamplingConfig(cfg_scale=7.5))
    ar = bundle_plan(bundle, DecodeConfig(method="ar", dtype="bfloat16"), 141 * GB)
    assert ar.weights["target"] == (777_678_080 + 245_760) * 2
    assert ar.weights["drafter"] == 44_567_040 * 2
    assert ar.weights["vq"] == (71_883_403 + 65_536) * 4  # fp32 decoder, codebook_used buffer included
    assert ar.rows_per_image == 2 and ar.drafter_kv_per_image == 0
    assert ar.target_kv_per_image == 2 * 36 * 2 * 1280 * (120 + 1024 + 2) * 2  # CFG rows x layers x k,v x width
    assert ar.workspace_bytes == 4 * 128 * 512 * 512 * 4  # estimate: one image decoded to pixels
    spec = bundle_plan(bundle, DecodeConfig(method="eagle2", dtype="bfloat16"), 141 * GB)
    widest = DecodeConfig().adaptive.n_max  # eagle2's tree sized for the device: at most n_max nodes,
    room = min(widest, ROOM)  # in rows with ROOM nodes past the image's end (trees there fit what is left)
    assert spec.target_kv_per_image == 2 * 36 * 2 * 1280 * (120 + 1024 + room + 2) * 2
    assert spec.tree_per_image == 2 * 2 * (widest + 1) * 16384 * 4  # a verify's logits (16384 codes): the widest tree
    assert spec.drafter_kv_per_image > 0 and spec.per_image > ar.per_image
    assert 64 == spec.images < spec.fits  # decode.batch_size caps it
    nocfg = bundle_plan(bundle, DecodeConfig(method="ar", dtype="bfloat16", cfg_scale=1.0), 141 * GB)
    assert nocfg.target_kv_per_image * 2 == ar.target_kv_per_image
    assert set(ar.to_dict()) >= {"weights", "weights_total", "per_image", "target_kv_per_image", "images"}


def test_bundle_plan_counts_the_loaded_bundle(published):
    bundle = load_manifest_bundle(write_manifest(published.root / "mem.yaml", manifest_dict()))
    plan = bundle_plan(bundle, DecodeConfig(method="eagle2", dtype="float32"), 8 * GB)
    assert plan.weights == bundle.component_bytes()  # fp32 everywhere here, text encoder included
    assert plan.rows_per_image == 2  # cfg_scale 4.0 in the manifest
    half = bundle_plan(bundle, DecodeConfig(method="eagle2", dtype="bfloat16"), 8 * GB)
    assert half.weights["target"] * 2 == plan.weights["target"]


# ---- the shipped manifests (infra/manifests) ------------------------------------------------------
MANIFESTS = Path(__file__).resolve().parents[2] / "infra" / "manifests"


@pytest.mark.parametrize("name,grid", [("llamagen_t2i_stage1.yaml", 16), ("llamagen_t2i_stage2.yaml", 32)])
def test_shipped_manifests_parse(name, grid, monkeypatch):
    monkeypatch.delenv("ADT_MODELS", raising=False)
    with pytest.raises(ManifestError, match="ADT_MODELS not set"):
        read_manifest(MANIFESTS / name)
    monkeypatch.setenv("ADT_MODELS", "s3://my-bucket/models")
    m = read_manifest(MANIFESTS / name)
    assert m.grid == (grid, grid)
    assert m.target.path == f"s3://my-bucket/models/llamagen/t2i_XL_stage{1 if grid == 16 else 2}_{16 * grid}.pt"
    assert m.drafter.path.startswith("s3://my-bucket/models/lantern/llamagen")
    assert m.vq.path == "s3://my-bucket/models/llamagen/vq_ds16_t2i.pt"
    assert m.text_encoder == {"type": "t5", "path": "s3://my-bucket/models/google/flan-t5-xl/", "dtype": "bfloat16",
                              "device": "auto", "max_tokens": 120}
    assert (m.sampling.temperature, m.sampling.top_k, m.sampling.top_p, m.sampling.cfg_scale) == (1.0, 1000, 1.0, 7.5)


def test_stage1_manifest_loads_the_documented_layout(tmp_path, monkeypatch):
    """Tiny files at the real caption length (120) and grid (16), in the layout of docs/real_models.md."""
    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=32, cls_token_num=120, caption_dim=16, grid_h=16,
                    grid_w=16, multiple_of=64)
    root = tmp_path / "models"
    (root / "llamagen").mkdir(parents=True)
    write_llamagen_pt(tiny_gpt(cfg), root / "llamagen" / "t2i_XL_stage1_256.pt")
    write_vq_pt(tiny_vq(), root / "llamagen" / "vq_ds16_t2i.pt")
    write_lantern_drafter(tiny_drafter(cfg), root / "lantern" / "llamagen_drafter", target=cfg)
    write_tiny_t5(root / "google" / "flan-t5-xl")
    monkeypatch.setenv("ADT_MODELS", str(root))
    # the real file's args say gpt_model="GPT-XL" (20 heads); the tiny one says "GPT-tiny"
    monkeypatch.setitem(llamagen_checkpoints.LLAMAGEN_SIZES, "GPT-tiny", 4)
    bundle = adt_core.load_bundle(MANIFESTS / "llamagen_t2i_stage1.yaml")
    assert bundle.grid == (16, 16) and bundle.target.config.cls_token_num == 120
    assert bundle.text_encoder.max_tokens == 120 and bundle.drafter.config.grid_h == 16
    emb, mask = bundle.text_encoder.encode(["a red apple"])
    assert emb.shape == (1, 120, 16) and mask[0, -4:].all() and not mask[0, :-4].any()


# ---- one storage configuration for models and outputs (hf://: test_hub_cache.py) ----------------------------------


def test_s3_manifest_uses_the_jobs_storage_settings(published, s3, tmp_path, monkeypatch, moto_endpoint):
    """The endpoint comes only from --storage.endpoint-url (no AWS_ENDPOINT_URL): the
    pipeline hands the manifest loader a client built from the job's storage settings."""
    from pipeline.config import StorageSettings
    from pipeline.worker import load_bundle_spec

    names = ["t2i_XL_stage1_256.pt", "llamagen_drafter", "vq_ds16_t2i.pt", "flan-t5-xl"]
    upload_tree(s3.client, s3.bucket, published.root, names)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    path = write_manifest(tmp_path / "s3.yaml", manifest_dict(root=f"s3://{s3.bucket}/llamagen", cache_dir="cache"))
    made = []
    import pipeline.s3

    real = pipeline.s3.model_s3_client
    monkeypatch.setattr(pipeline.s3, "model_s3_client", lambda settings=None: made.append(settings) or real(settings))
    settings = StorageSettings(endpoint_url=moto_endpoint, region="us-east-1", retry_budget_s=30, timeout_s=5)
    bundle = load_bundle_spec(str(path), settings)
    assert made == [settings] and same_weights(bundle.target, published.gpt)
    client = real(settings)
    retries = client.meta.config.retries
    assert retries.get("total_max_attempts", retries.get("max_attempts", 0) + 1) == 7  # 30 s budget / 5 s timeout + 1
    assert client.meta.config.read_timeout == 5
