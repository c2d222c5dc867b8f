"""The shipped Chameleon-family manifests (infra/manifests/anole_7b.yaml, lumina_mgpt_7b_768.yaml):
hf:// sources, the licence, the ADT-Tree scripts' sampling defaults; parsed by `jobs.generate
--bundle <manifest>` and resolved OFFLINE from a Hugging Face cache laid out as huggingface_hub
stores it (tiny random files under the real repository ids; every socket refused)."""

import io
import socket
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from adt_core.bundles.family_manifest import read_family_manifest
from adt_core.bundles.loader import read_any_manifest
from adt_core.bundles.sources import ManifestError, split_hf
from adt_core.config import SamplingConfig

from test_hub_cache import put_in_hub_cache
from test_manifest import s3  # noqa: F401 - a fixture (a bucket on the session's moto server)

MANIFESTS = Path(__file__).resolve().parents[2] / "infra" / "manifests"
ADT_TREE_SAMPLING = SamplingConfig(temperature=1.0, top_k=2000, top_p=1.0, cfg_scale=3.0)
REPOS = {  # part -> (repository, path in it) as the manifests name them
    "anole_7b.yaml": {"target": ("leloy/Anole-7b-v0.1-hf", ""), "tokenizer": ("leloy/Anole-7b-v0.1-hf", ""),
                      "vq": ("GAIR/Anole-7b-v0.1", "tokenizer/"), "drafter": ("jadohu/anole_drafter", ""),
                      "neighbours": ("sihwanpark/LANTERN-Lumina-mGPT-7B-768", "top_8191_indices.npy")},
    "lumina_mgpt_7b_768.yaml": {"target": ("Alpha-VLLM/Lumina-mGPT-7B-768", ""),
                                "vq": ("GAIR/Anole-7b-v0.1", "tokenizer/"),
                                "drafter": ("sihwanpark/LANTERN-Lumina-mGPT-7B-768", ""),
                                "neighbours": ("sihwanpark/LANTERN-Lumina-mGPT-7B-768", "top_8191_indices.npy")},
}


@pytest.mark.parametrize("name,layout", [("anole_7b.yaml", "anole"), ("lumina_mgpt_7b_768.yaml", "lumina")])
def test_shipped_manifest_names_hub_sources_licence_and_defaults(name, layout):
    m = read_family_manifest(MANIFESTS / name)
    assert m.family == "chameleon" and m.prompt["layout"] == layout and m.dtype == "bfloat16"
    assert {k: split_hf(p.path)[::2] for k, p in m.parts.items()} == REPOS[name]
    assert m.parts["vq"].files == ("vqgan.yaml", "vqgan.ckpt")
    assert m.license["model"].startswith("Chameleon Research License")
    assert m.sampling == ADT_TREE_SAMPLING
    assert read_any_manifest(MANIFESTS / name).name == m.name
    from jobs.generate import main  # the job's CLI takes the manifest as --bundle

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["--bundle", str(MANIFESTS / name), "--print-config"]) == 0
    assert str(MANIFESTS / name) in out.getvalue()


def test_manifest_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("family: chameleon\ntarget: x\nvq: {path: y, files: [a/b]}\n")
    with pytest.raises(ManifestError, match="vq.files must be a list of file names"):
        read_family_manifest(bad)
    bad.write_text("family: nope\ntarget: x\nvq: y\n")
    with pytest.raises(ManifestError, match="unknown model family 'nope'"):
        read_family_manifest(bad)
    bad.write_text("family: chameleon\ntarget: x\nvq: y\nlicence: z\n")
    with pytest.raises(ManifestError, match=r"unknown fields \['licence'\]"):
        read_family_manifest(bad)


@pytest.fixture
def anole_hub(anole_dir, tmp_path, monkeypatch):
    """The tiny Anole files (conftest.py) under the repository ids the shipped manifest names,
    in a tmp Hub cache; offline, and no socket may connect."""
    import torch
    from huggingface_hub import constants
    from safetensors.torch import load_file

    bin_dir = tmp_path / "drafter_bin"  # jadohu/anole_drafter holds pytorch_model.bin
    bin_dir.mkdir()
    torch.save(load_file(str(anole_dir / "drafter" / "model.safetensors")), bin_dir / "pytorch_model.bin")
    drafter = {"config.json": anole_dir / "drafter" / "config.json", "pytorch_model.bin": bin_dir / "pytorch_model.bin"}
    files = lambda d: {f.name: f for f in sorted((anole_dir / d).iterdir())}  # noqa: E731
    hub_dir = tmp_path / "hf_home" / "hub"
    put_in_hub_cache(hub_dir, "leloy/Anole-7b-v0.1-hf", files("target"))
    put_in_hub_cache(hub_dir, "GAIR/Anole-7b-v0.1", {f"tokenizer/{k}": v for k, v in files("vq").items()})
    put_in_hub_cache(hub_dir, "jadohu/anole_drafter", drafter)
    table = anole_dir / "drafter" / "top_8191_indices.npy"
    put_in_hub_cache(hub_dir, "sihwanpark/LANTERN-Lumina-mGPT-7B-768", {"top_8191_indices.npy": table})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_dir))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    return np.load(table)


def test_shipped_anole_manifest_resolves_offline_through_the_job(anole_hub):
    import torch

    from pipeline.worker import load_bundle_spec

    bundle = load_bundle_spec(str(MANIFESTS / "anole_7b.yaml"))  # what each actor loads
    assert bundle.family == "chameleon" and bundle.name == "anole-7b-512"
    assert bundle.target.lm_head.weight.dtype == torch.bfloat16  # the manifest's dtype
    assert bundle.grid == (32, 32) and bundle.prompter.layout.end == 8196
    assert bundle.sampling == ADT_TREE_SAMPLING
    assert torch.equal(bundle.neighbour_table(3), torch.from_numpy(anole_hub[:, :3].astype(np.int64)))
    rows = bundle.prompter.rows(["an apple"], cfg=True)
    assert rows.tokens[1, :2].tolist() == [0, 8197]  # uncond: BOS + image start


def test_a_family_manifest_reads_s3_copies(anole_dir, s3, tmp_path):
    """The same parts from an S3 prefix (moto on loopback), the VQGAN's two files by name, with
    sha256 pinned; then from the local cache."""
    from adt_core.bundles.family_manifest import load_family_manifest
    from adt_core.bundles.sources import sha256_file
    from test_manifest import upload_tree

    upload_tree(s3.client, s3.bucket, anole_dir, ["target", "vq", "drafter"], prefix="anole")
    ckpt = anole_dir / "vq" / "vqgan.ckpt"
    root = f"s3://{s3.bucket}/anole"
    manifest = tmp_path / "anole_s3.yaml"
    manifest.write_text(
        f"family: chameleon\nname: anole-s3\ncache_dir: {tmp_path / 'cache'}\n"
        f"target: {root}/target/\ndrafter: {root}/drafter/\n"
        f"vq: {{path: {root}/vq/, files: [vqgan.yaml, vqgan.ckpt], sha256: {{vqgan.ckpt: {sha256_file(ckpt)}}}}}\n"
        "prompt: {layout: anole}\nsampling: {temperature: 1.0, top_k: 2000, cfg_scale: 3.0}\n")
    bundle = load_family_manifest(manifest)
    assert bundle.name == "anole-s3" and bundle.grid == (32, 32)
    assert bundle.neighbours is not None and bundle.neighbours.name == "top_8191_indices.npy"  # in the drafter prefix
    assert (tmp_path / "cache" / "s3" / s3.bucket / "anole" / "vq" / "vqgan.yaml").is_file()
    bad = manifest.read_text().replace(sha256_file(ckpt), "0" * 64)
    manifest.write_text(bad.replace(str(tmp_path / "cache"), str(tmp_path / "cache2")))
    with pytest.raises(Exception, match="sha256"):
        load_family_manifest(manifest)
