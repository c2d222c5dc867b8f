"""The contract test, parametrised over the registry: for each registered family's tiny fixture,
every method the bundle supports equals `ar` token for token in fp32, greedy and coupled, CFG 1
and 3, batch 1 and 3.

Then a family defined entirely inside tests/ (tests/adt_core/toy_family.py: a toy target,
drafter, prompter and decoder from the shared layers and the contract) is registered with
`registry.register`, runs the same contract round, and runs the generate job (pipeline.driver's
`run_job` on the session's local Ray, the bundle a family bundle directory the registry
resolves): a family is one folder and one registry line, and no production file names it.
"""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import torch

from adt_core import DecodeConfig, Generator, load_bundle, random_bundle
from adt_core.families import registry
from adt_core.families.contract import Decoder, Drafter, Prompter, Target

import toy_family
from test_chameleon_round import make_bundle as chameleon_bundle
from test_chameleon_round import COSTS, METHODS

PROMPTS = ["an apple", "a dog on the grass", "sun"]
SEEDS = [3, 1, 4]


def llamagen_fixture(root):
    return random_bundle(seed=11, vocab=24, grid=(3, 5))


def chameleon_fixture(root):
    return chameleon_bundle(root, "lumina", width=64, height=48)  # 3 x 4 codes, an end-of-line per row


def janus_fixture(root):
    pytest.importorskip("transformers.models.janus", reason="transformers >= 4.52 has models/janus")
    from janus_fixtures import make_hf_janus, make_tokenizer, save_published

    from adt_core.bundles.family_bundle import write_family_bundle
    from adt_core.families.janus.drafter import new_drafter, save_janus_drafter
    from adt_core.families.janus.weights import load_janus

    save_published(make_hf_janus(seed=2), root / "target")
    make_tokenizer(root / "target" / "tokenizer.json")
    save_janus_drafter(new_drafter(load_janus(root / "target"), seed=0), root / "drafter")
    comps = {"target": "target", "vq": "target", "tokenizer": "target", "drafter": "drafter"}
    return load_bundle(write_family_bundle(root, "tiny-janus", "janus", comps, {"grid": 4}))


FIXTURES = {"llamagen": llamagen_fixture, "chameleon": chameleon_fixture, "janus": janus_fixture}


def run(bundle, method, batch_size, **kw):
    """Token grids (images, N) and the drafted tokens the images accepted."""
    g = Generator(bundle, DecodeConfig(method=method, batch_size=batch_size, **kw))
    g.use_costs(COSTS)
    res = g.generate(PROMPTS, SEEDS)
    return torch.stack([r.tokens.flatten() for r in res]), sum(r.stats.accepted_draft_tokens for r in res)


def methods_of(bundle):
    """The methods a bundle supports: every one with a drafter, else those that need none."""
    return [(m, extra) for m, extra in METHODS if bundle.drafter is not None or not DecodeConfig(method=m).needs_drafter]


def check_every_method_equals_ar(bundle):
    accepted = {}  # method -> drafted tokens accepted over every run: the drafts were really verified
    methods = [("ar", {})] + methods_of(bundle)
    for cfg_scale in (1.0, 3.0):
        for temperature in (0.0, 1.0):
            kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=8 if temperature else 0, dtype="float32")
            ref, _ = run(bundle, "ar", 1, **kw)
            for i, (method, extra) in enumerate(methods):
                for bs in (1, 3):
                    out, acc = run(bundle, method, bs, **kw, **extra)
                    assert torch.equal(out, ref), (bundle.family, method, extra, bs, cfg_scale, temperature)
                    accepted[i] = accepted.get(i, 0) + acc
    assert all(accepted[i] > 0 for i in range(1, len(methods))), (bundle.family, accepted)


@pytest.mark.parametrize("family", registry.family_names())
def test_every_method_equals_ar_on_each_registered_family(family, tmp_path):
    assert family in FIXTURES, f"family {family!r} is registered but has no tiny fixture here"
    bundle = FIXTURES[family](tmp_path)
    assert bundle.family == family
    check_every_method_equals_ar(bundle)


# ---- a family from outside: one folder, one registry line ----------------------------------
@pytest.fixture
def toy(tmp_path):
    """The toy family registered (and unregistered after), and a toy bundle directory."""
    registry.register(toy_family.NAME, toy_family.FAMILY)
    try:
        yield toy_family.save_toy_bundle(tmp_path / "toy_bundle")
    finally:
        registry.unregister(toy_family.NAME)


def test_a_family_registered_from_tests_runs_the_contract_round(toy):
    bundle = load_bundle(toy)
    assert bundle.family == "toy" and isinstance(bundle.target, toy_family.ToyTarget)
    assert isinstance(bundle.target, Target) and isinstance(bundle.drafter, Drafter)
    assert isinstance(bundle.vq, Decoder) and isinstance(bundle.prompter, Prompter)
    check_every_method_equals_ar(bundle)


def test_the_generate_job_runs_a_family_registered_from_tests(toy, tmp_path, ray_session):
    import pyarrow as pa

    from pipeline.config import build_config
    from pipeline.driver import run_job
    from pipeline.exit_codes import EXIT_OK

    rows = [{"prompt_id": f"t{i}", "prompt": p, "seed": s} for i, (p, s) in enumerate(zip(PROMPTS, SEEDS))]
    src = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    cfg = build_config({"job_id": "toy", "bundle": str(toy), "input": str(src), "output": str(tmp_path / "out"),
                        "num_actors": 1, "batch_size": len(rows),
                        "decode": {"method": "eagle2", "batch_size": 3}})
    toy_family.ship_by_value()
    res = run_job(cfg, worker=toy_family.toy_worker())
    assert res.exit_code == EXIT_OK and res.summary["ok"] == len(rows)
    tele = {r["prompt_id"]: r for r in pq.read_table(tmp_path / "out" / "telemetry").to_pylist()}
    ref = Generator(load_bundle(toy), DecodeConfig(method="ar", batch_size=3)).generate(PROMPTS, SEEDS)
    for row, r in zip(rows, ref):
        assert tele[row["prompt_id"]]["status"] == "ok" and tele[row["prompt_id"]]["method"] == "eagle2"
        assert tele[row["prompt_id"]]["tokens"] == r.tokens.flatten().tolist()
