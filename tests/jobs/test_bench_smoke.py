"""jobs.bench end to end on a tiny random bundle: every method, the table as JSON, heatmaps, sweep."""

from __future__ import annotations

import json

import torch
from PIL import Image

from jobs import bench


def _tiny(tmp_path, *extra):
    return ["--bundle", "random", "--dim", "32", "--layers", "2", "--heads", "2", "--vocab", "32",
            "--grid", "4", "4", "--caption-len", "4", "--limit", "2", "--prompts", str(tmp_path / "none.parquet"),
            *extra]


def test_methods_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("ADT_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    out, png = tmp_path / "bench.json", tmp_path / "maps.png"
    assert bench.main(_tiny(tmp_path, "--json", str(out), "--heatmaps", str(png), "--temperatures", "0,default")) == 0
    res = json.loads(out.read_text())
    greedy, sampled = res["tables"]["0"], res["tables"]["default"]
    assert set(greedy) == {"ar", "static", "eagle2", "adt", "adt+cost", "adt+lantern", "adt+cost+lantern"}
    for name, row in greedy.items():
        assert row["equals_ar"] or row["lossy"], name  # lossless methods reproduce greedy AR
        assert row["speedup"] > 0 and row["mean_acceptance_length"] >= 1.0
    assert greedy["adt+lantern"]["lossy"] and not greedy["adt"]["lossy"]
    assert sampled["adt"]["equals_ar"] and sampled["adt"]["sampler"] == "coupled"  # coupled: exact when sampled too
    assert Image.open(png).size[0] > 0


def test_samplers_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("ADT_CACHE_DIR", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    out = tmp_path / "bench.json"
    assert bench.main(_tiny(tmp_path, "--json", str(out), "--temperatures", "1.0", "--methods", "eagle2,adt+cost",
                            "--samplers", "coupled,rejection", "--draft-scores", "perturbed,logq")) == 0
    table = json.loads(out.read_text())["tables"]["1.0"]
    assert set(table) == {"ar [coupled]", "ar [rejection]", "eagle2 [coupled/perturbed]", "eagle2 [coupled/logq]",
                          "eagle2 [rejection]", "adt+cost [coupled/perturbed]", "adt+cost [coupled/logq]",
                          "adt+cost [rejection]"}
    for name, row in table.items():
        assert row["sampler"] == name.split("[")[1].split("/")[0].rstrip("]")
        if row["sampler"] == "coupled":
            assert row["equals_ar"], name
        else:
            assert "equals_ar" not in row


def test_sweep_lists_every_variant(tmp_path):
    out = tmp_path / "sweep.json"
    assert bench.main(_tiny(tmp_path, "--sweep", "--limit", "1", "--json", str(out))) == 0
    table = json.loads(out.read_text())["tables"]["sweep@0"]
    assert {"ar", "eagle2", "adt (defaults)", "beta=0.3", "init=both", "mode=step", "budget=cost"} <= set(table)
    assert all(row["equals_ar"] for row in table.values())
