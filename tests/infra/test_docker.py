"""The job image and its pinned requirements.

- The pins match pyproject.toml's ranges and the versions this test suite runs with.
- A fresh venv here installs them: `pip install --dry-run` resolves every pin and its
  dependencies against the package index (network: opt-in with ADT_NETWORK_TESTS=1, since
  tests fetch nothing by default).
- The Dockerfile builds where a Docker daemon answers (skipped otherwise, with the reason).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "infra" / "docker" / "requirements.txt"


def pins() -> dict[str, Requirement]:
    lines = [ln.split("#", 1)[0].strip() for ln in REQS.read_text().splitlines()]
    return {Requirement(ln).name.lower().replace("_", "-"): Requirement(ln) for ln in lines if ln}


def test_pins_cover_pyproject_and_match_the_tested_versions():
    """Core dependencies and the t5 extra (FLAN-T5 caption cleaning), each pinned."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {Requirement(r).name.lower().replace("_", "-"): Requirement(r)
            for r in project["dependencies"] + project["optional-dependencies"]["t5"]}
    got = pins()
    assert set(got) == set(core), set(got) ^ set(core)
    for name, req in got.items():
        (spec,) = req.specifier
        assert spec.operator == "==", f"{name} is not pinned"
        assert core[name].specifier.contains(spec.version), f"{name}=={spec.version} outside {core[name]}"
        installed = Version(md.version(name)).base_version  # torch 2.13.0+cpu here, the CUDA build in the image
        assert installed == Version(spec.version).base_version, f"{name}: tests run {installed}, pinned {spec.version}"
    assert got["ray"].extras == {"data", "default"}


def test_dockerfile_installs_the_pins_then_the_project():
    text = (ROOT / "infra" / "docker" / "Dockerfile").read_text()
    assert "FROM rayproject/ray:2.60.0-py311-gpu" in text
    assert text.index("-r /tmp/adt-tree-requirements.txt") < text.index("--no-deps .")
    assert "load_bundle('emoji16')" in text  # the embedded bundle and its text encoder are inside
    assert "import ftfy, bs4" in text  # the FLAN-T5 caption cleaner's packages are inside


@pytest.mark.skipif(os.environ.get("ADT_NETWORK_TESTS") != "1",
                    reason="resolves against the package index: set ADT_NETWORK_TESTS=1 to run")
def test_pins_install_into_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    done = subprocess.run(pip + ["install", "--dry-run", "--quiet", "--report", str(tmp_path / "report.json"),
                                 "-r", str(REQS)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    chosen = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"]
              for i in json.loads((tmp_path / "report.json").read_text())["install"]}
    for name, req in pins().items():
        # base version: a machine whose pip is set up with the CPU wheel index resolves torch 2.13.0+cpu
        assert Version(chosen[name]).base_version == Version(next(iter(req.specifier)).version).base_version


def _docker_unavailable() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed"
    probe = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=60)
    return None if probe.returncode == 0 else f"the docker daemon does not answer: {probe.stderr.strip()[:200]}"


@pytest.mark.slow
def test_dockerfile_builds():
    why = _docker_unavailable()
    if why:
        pytest.skip(why)
    tag = "adt-tree-test:build"
    done = subprocess.run(["docker", "build", "-f", "infra/docker/Dockerfile", "-t", tag, "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    run = subprocess.run(["docker", "run", "--rm", tag, "python", "-m", "jobs.generate", "--help"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "--output-format" in run.stdout
