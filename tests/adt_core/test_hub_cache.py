"""hf:// manifest paths through huggingface_hub's own cache, offline: a cache pre-populated in
the hub's real layout (models--<owner>--<repo>/{blobs,refs,snapshots}) under a temporary
HF_HOME, HF_HUB_OFFLINE on and every socket refused, so nothing can reach a network."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import huggingface_hub
from huggingface_hub import constants
from adt_core.bundles import hub
from adt_core.bundles.hub import allow_patterns, fetch_hf, is_directory
from adt_core.bundles.manifest import load_manifest_bundle
from adt_core.bundles.sources import ChecksumError, ManifestError, sha256_file, split_hf
from test_checkpoints import same_weights
from test_manifest import manifest_dict, published, write_manifest  # noqa: F401 - `published` is a fixture

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# what google/flan-t5-xl holds: one model in four weight formats
FLAN_T5_FILES = [
    "README.md", "config.json", "generation_config.json", "special_tokens_map.json", "spiece.model",
    "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
    "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "pytorch_model.bin.index.json",
    "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin", "tf_model.h5", "flax_model.msgpack",
]


def put_in_hub_cache(hub_dir: Path, repo: str, files: dict[str, Path], ref: str = "main") -> Path:
    """Files laid out as huggingface_hub stores them: content in blobs/<sha256>, the snapshot
    of a commit as relative symlinks to the blobs, refs/<branch> naming the commit."""
    root = hub_dir / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / COMMIT
    for rel, src in files.items():
        blob = root / "blobs" / sha256_file(src)
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, blob)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(COMMIT)
    return snapshot


def tree(root: Path, name: str) -> dict[str, Path]:
    return {f"{name}/{f.relative_to(root / name)}": f for f in sorted((root / name).rglob("*")) if f.is_file()}


@pytest.fixture
def offline_hub(tmp_path, monkeypatch, published):  # noqa: F811
    """A tmp HF_HOME holding org/llamagen (target, drafter, VQ, FLAN-T5) in the hub layout;
    offline mode on and no socket may connect."""
    hub_dir = tmp_path / "hf_home" / "hub"
    files = {"t2i_XL_stage1_256.pt": published.root / "t2i_XL_stage1_256.pt",
             "vq_ds16_t2i.pt": published.root / "vq_ds16_t2i.pt",
             **tree(published.root, "llamagen_drafter"), **tree(published.root, "flan-t5-xl")}
    snapshot = put_in_hub_cache(hub_dir, "org/llamagen", files)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    calls = []
    real = huggingface_hub.snapshot_download

    def spy(*args, **kwargs):
        calls.append(kwargs.get("allow_patterns"))
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", spy)
    return snapshot, calls


def test_urls_and_the_directory_rule():
    assert split_hf("hf://FoundationVision/LlamaGen@v1/t2i/x.pt") == ("FoundationVision/LlamaGen", "v1", "t2i/x.pt")
    assert split_hf("hf://google/flan-t5-xl") == ("google/flan-t5-xl", "main", "")
    with pytest.raises(ManifestError):
        split_hf("hf://only-owner")
    with pytest.raises(ManifestError, match="'..'"):
        split_hf("hf://a/b/../c.pt")
    assert [is_directory(s) for s in ("", "drafter/", "lantern/llamagen_drafter", "t2i_XL_stage1_256.pt")] == \
        [True, True, True, False]


def test_a_directory_gets_its_small_files_and_one_weight_format():
    from huggingface_hub.utils import filter_repo_objects

    got = set(filter_repo_objects(FLAN_T5_FILES, allow_patterns=allow_patterns("", hub.WEIGHT_FORMATS[0])))
    assert got == {"config.json", "generation_config.json", "special_tokens_map.json", "spiece.model",
                   "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
                   "pytorch_model.bin.index.json", "model-00001-of-00002.safetensors",
                   "model-00002-of-00002.safetensors"}
    bins = set(filter_repo_objects(FLAN_T5_FILES, allow_patterns=allow_patterns("", hub.WEIGHT_FORMATS[1])))
    assert {f for f in bins if not f.endswith((".json", ".model"))} == {
        "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"}
    assert allow_patterns("lantern/drafter", ("*.bin",)) == [
        "lantern/drafter/*.json", "lantern/drafter/*.model", "lantern/drafter/*.txt", "lantern/drafter/*.bin"]


@pytest.mark.parametrize("revision", ["", f"@{COMMIT}"])
def test_manifest_loads_from_the_hub_cache_offline_with_checksums(published, offline_hub, tmp_path, revision):  # noqa: F811
    snapshot, calls = offline_hub
    repo = f"hf://org/llamagen{revision}"
    m = manifest_dict(root=repo, cache_dir=str(tmp_path / "adt-cache"))
    m["target"]["sha256"] = sha256_file(published.root / "t2i_XL_stage1_256.pt")
    m["drafter"] = {"path": f"{repo}/llamagen_drafter",  # no dot in the last segment: a directory
                    "sha256": {"pytorch_model.bin": sha256_file(published.root / "llamagen_drafter" / "pytorch_model.bin")}}
    bundle = load_manifest_bundle(write_manifest(tmp_path / "hf.yaml", m))
    assert same_weights(bundle.target, published.gpt) and same_weights(bundle.drafter, published.drafter)
    assert same_weights(bundle.vq, published.vq) and bundle.text_encoder.path == str(snapshot / "flan-t5-xl")
    assert not (tmp_path / "adt-cache").exists()  # nothing copied outside the hub's cache
    # the drafter has no safetensors: its folder was asked for safetensors, then for .bin;
    # FLAN-T5 for safetensors only. Never more than one weight format per call.
    assert calls == [allow_patterns("llamagen_drafter", w) for w in hub.WEIGHT_FORMATS[:2]] + [
        allow_patterns("flan-t5-xl", hub.WEIGHT_FORMATS[0])]

    m["drafter"]["sha256"]["pytorch_model.bin"] = "0" * 64  # the cached file is not what the manifest pins
    with pytest.raises(ChecksumError, match="llamagen_drafter/pytorch_model.bin: sha256 .* does not match"):
        load_manifest_bundle(write_manifest(tmp_path / "bad.yaml", m))


def test_a_file_missing_from_the_offline_cache_names_the_download_command(offline_hub):
    with pytest.raises(FileNotFoundError, match="hf download org/llamagen --revision main not_there.pt"):
        fetch_hf("hf://org/llamagen/not_there.pt")
    with pytest.raises(FileNotFoundError, match="hf download other/repo --revision main --include"):
        fetch_hf("hf://other/repo/")
    snapshot, _ = offline_hub
    with pytest.raises(FileNotFoundError, match="no weights"):
        fetch_hf("hf://org/llamagen/no_such_folder/")


def test_hf_home_and_offline_mode_are_read_from_the_environment(published, tmp_path):  # noqa: F811
    """A fresh process: huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported."""
    home = tmp_path / "home"
    put_in_hub_cache(home / "hub", "org/llamagen", {"vq_ds16_t2i.pt": published.root / "vq_ds16_t2i.pt"})
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(ROOT))
    code = "from adt_core.bundles.hub import fetch_hf; print(fetch_hf('hf://org/llamagen/vq_ds16_t2i.pt'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(home / "hub" / "models--org--llamagen" / "snapshots" / COMMIT / "vq_ds16_t2i.pt")


def test_the_shipped_hub_manifest_loads_from_the_cache_offline(tmp_path, monkeypatch):
    """infra/manifests/llamagen_t2i_stage1_hub.yaml against tiny files at the real caption
    length (120) and grid (16), cached under the three real repository names."""
    import adt_core
    from adt_core.families.llamagen import weights as llamagen_checkpoints
    from adt_core.families.llamagen.model import GPTConfig
    from test_checkpoints import tiny_drafter, tiny_gpt, tiny_vq, write_lantern_drafter, write_llamagen_pt, write_vq_pt
    from test_t5 import write_tiny_t5

    cfg = GPTConfig(dim=64, n_layer=1, n_head=4, vocab_size=32, cls_token_num=120, caption_dim=16, grid_h=16,
                    grid_w=16, multiple_of=64)
    src = tmp_path / "src"
    (src / "llamagen").mkdir(parents=True)
    write_llamagen_pt(tiny_gpt(cfg), src / "llamagen" / "t2i_XL_stage1_256.pt")
    write_vq_pt(tiny_vq(), src / "llamagen" / "vq_ds16_t2i.pt")
    write_lantern_drafter(tiny_drafter(cfg), src / "drafter", target=cfg)
    write_tiny_t5(src / "t5")
    hub_dir = tmp_path / "hf_home" / "hub"
    put_in_hub_cache(hub_dir, "peizesun/llamagen_t2i", {f.name: f for f in (src / "llamagen").iterdir()})
    put_in_hub_cache(hub_dir, "jadohu/llamagen_drafter", {f.name: f for f in (src / "drafter").iterdir()})
    put_in_hub_cache(hub_dir, "google/flan-t5-xl", {f.name: f for f in (src / "t5").iterdir()})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("network"))
    monkeypatch.setitem(llamagen_checkpoints.LLAMAGEN_SIZES, "GPT-tiny", 4)  # the real file says GPT-XL
    bundle = adt_core.load_bundle(ROOT / "infra" / "manifests" / "llamagen_t2i_stage1_hub.yaml")
    assert bundle.grid == (16, 16) and bundle.text_encoder.max_tokens == 120 and bundle.drafter.config.grid_h == 16
    assert bundle.text_encoder.path == str(hub_dir / "models--google--flan-t5-xl" / "snapshots" / COMMIT)
