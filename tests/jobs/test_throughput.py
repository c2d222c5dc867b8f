"""`python -m jobs.bench --throughput` on a tiny random bundle: methods run together round by
round (every second of decoding charged to one method), the control `ar'` and `adt` produce
`ar`'s images, and the JSON holds every cell. Speed itself is not asserted here."""

from __future__ import annotations

import itertools
import json
import time
from types import SimpleNamespace

import torch

from adt_core.bundles.bundle import random_bundle
from jobs import bench, throughput
from jobs.throughput import METHODS, make_generator, run_together, workload

ARGS = ["--throughput", "--bundle", "random", "--grid", "4", "4", "--dim", "64", "--layers", "2", "--heads", "4",
        "--vocab", "64", "--caption-len", "8", "--prompts", "/nonexistent.parquet"]


def test_throughput_cells_with_control(tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert bench.main(ARGS + ["--methods", "ar,adt", "--batches", "1,3", "--temperatures", "0,default",
                              "--passes", "2", "--min-images", "2", "--control", "--json", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {f"{t}|{b}|{m}" for t in ("0", "default") for b in (1, 3) for m in ("ar", "adt", "ar'")}
    for key, c in cells.items():
        assert c["images"] == (4 if key.split("|")[1] == "1" else 12)
        assert len(c["passes"]) == 2 and c["images_per_s"] == max(c["passes"])
        assert c["equals_ar"] is True  # greedy at T 0, coupled at the defaults
        if key.endswith("|ar"):  # ar's plain step per image is the unit
            assert c["plain_ms_per_image_step"] > 0 and c["plain_x_ar"] == 1.0
            assert c["occupancy"] is None  # untraced: its waves step together
        else:  # a method that drafted every round has none to compare
            assert (c["plain_x_ar"] is None) is (c["plain_ms_per_image_step"] == 0.0)
        if key.endswith("|adt"):
            assert 0.0 < c["occupancy"] <= 1.0
            f = c["ceiling"]["forecast"]  # the cost model checked on the rounds it sized
            assert f["rounds"] >= 0 and (f["tokens_ratio"] is None) is (f["rounds"] == 0)
    printed = capsys.readouterr().out
    assert "ar'" in printed and "vs ar@batch" in printed and "plain x ar" in printed and "busy" in printed
    assert "model tok/ms" in printed


def test_plain_step_and_occupancy_from_the_images_traces():
    """A full batch's plain step per image counts only plain rounds with every slot busy; the
    occupancy counts each round once (a round of a slots sits in a images' traces)."""
    from adt_core.results import RoundTrace, StepStats

    def trace(nodes, slots, draft_ms, verify_ms):
        return RoundTrace(0, 1 if nodes else 0, 0, nodes, 0, draft_ms, verify_ms, slots, slots)

    both = [trace(0, 2, 0.0, 5.0), trace(2, 2, 1.0, 6.0), trace(0, 2, 0.0, 5.0)]
    a = StepStats(rounds=both)
    b = StepStats(rounds=both + [trace(0, 1, 0.0, 10.0)])  # the wave's last round: b alone
    assert throughput.plain_ms([a, b], 2) == 5.0  # the emptier round is not a plain step's cost
    assert throughput.occupancy([a, b], 2) == 7 / 8  # 4 rounds, 7 busy slots of 8
    untraced = StepStats(plain_rounds=3, plain_ms=12.0)  # `ar`: every plain step
    assert throughput.plain_ms([untraced], 2) == 4.0 and throughput.occupancy([untraced], 2) is None


def test_run_together_charges_every_round_to_its_method(monkeypatch):
    b = random_bundle(seed=0, vocab=64, grid=(4, 4), dim=64, n_layer=2, n_head=4, caption_len=8)
    ps, ss = workload(["a cat", "a dog", "a red heart"], [1, 2, 3], 6)
    gens = {m: make_generator(b, METHODS[m], 0.0, 2, ps, ss, "cpu", "float32") for m in ("ar", "adt")}
    ticks = itertools.count()  # the harness's wall clock: one second per reading, so each round reads 1 s
    monkeypatch.setattr(throughput, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks)),
                                                             process_time=time.process_time))
    rounds = dict.fromkeys(gens, 1)  # each method's rounds + the call that ends it
    calls: list[str] = []  # the methods in the order their rounds ran

    def counted(m, inner):
        def it(prompts, seeds):
            for done in inner(prompts, seeds):
                rounds[m] += 1
                calls.append(m)
                yield done
        return it

    for m, g in gens.items():
        monkeypatch.setattr(g, "rounds", counted(m, g.rounds))
    cells = run_together(gens, ps, ss)
    assert all(c["images"] == 6 for c in cells.values())
    assert {m: c["wall_s"] for m, c in cells.items()} == {m: float(n) for m, n in rounds.items()}  # each round once
    assert cells["adt"]["tokens"] == cells["ar"]["tokens"]
    cycles = {tuple(calls[i:i + 2]) for i in range(0, 2 * min(rounds.values()) - 2, 2)}  # while both run
    assert cycles == {("ar", "adt"), ("adt", "ar")}  # each method takes each place (a seeded order per cycle)
    with torch.inference_mode():
        alone = gens["ar"].generate(ps, ss)
    assert [r.tokens.flatten().tolist() for r in alone] == cells["ar"]["tokens"]


def test_hand_sized_trees_parse_into_their_configs():
    """`eagle2@DxKxN` and `jacobi@N` name the hand-sized trees the defaults are compared with."""
    from adt_core import DecodeConfig

    e = DecodeConfig(**throughput.spec_for("eagle2@6x4x12"))
    assert (e.method, e.tree.depth, e.tree.top_k, e.tree.budget) == ("eagle2", 6, 4, 12)
    j = DecodeConfig(**throughput.spec_for("jacobi@4"))
    assert (j.method, j.adaptive.budget, j.adaptive.n_min, j.adaptive.n_max) == ("jacobi", "shape", 4, 4)
    assert throughput.spec_for("jacobi") == METHODS["jacobi"] and throughput.spec_for("nope") is None
