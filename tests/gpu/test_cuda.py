"""Device-only checks (skipped without CUDA): the engine's CUDA paths.

Run on a GPU machine: `python -m pytest -q tests/gpu -s` (prints the measured figures).
"""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, load_bundle, random_bundle
from adt_core.calibrate import measure_target_cost, typical_prefix
from adt_core.round.noise import uniforms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["a red apple", "blue dog", "green hill", "yellow sun"]


def run(bundle, **kw):
    res = Generator(bundle, DecodeConfig(device="cuda", **kw)).generate(PROMPTS, [0, 1, 2, 3])
    return torch.stack([r.tokens for r in res]), res


@pytest.mark.parametrize("method,extra", [
    ("eagle2", dict(tree=TreeConfig(depth=5, top_k=10, budget=58))),
    ("static", dict(tree=TreeConfig(depth=5))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="shape"))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="cost"))),
    ("jacobi", dict(adaptive=AdaptiveConfig(budget="cost"))),
])
def test_cuda_fp32_greedy_speculative_equals_vanilla(method, extra):
    bundle = random_bundle(seed=1, vocab=64, grid=(8, 8))
    ref, _ = run(bundle, method="ar", temperature=0.0, cfg_scale=3.0, dtype="float32")
    out, res = run(bundle, method=method, temperature=0.0, cfg_scale=3.0, dtype="float32", **extra)
    assert torch.equal(ref, out)
    assert all(r.tokens.device.type == "cpu" for r in res)


def test_cuda_sampling_is_seeded_and_runs_in_bf16():
    bundle = random_bundle(seed=2, vocab=64, grid=(8, 8))
    a, _ = run(bundle, method="adt", temperature=1.0, top_k=20, cfg_scale=2.0, dtype="bfloat16")
    b, _ = run(bundle, method="adt", temperature=1.0, top_k=20, cfg_scale=2.0, dtype="bfloat16")
    assert torch.equal(a, b)


def test_cuda_bf16_agreement_and_calibration_report():
    bundle = random_bundle(seed=3, vocab=1024, grid=(16, 16), dim=512, n_layer=6, n_head=8,
                           caption_len=32, caption_dim=64)
    ref, _ = run(bundle, method="ar", temperature=0.0, cfg_scale=3.0, dtype="bfloat16")
    out, _ = run(bundle, method="eagle2", temperature=0.0, cfg_scale=3.0, dtype="bfloat16")
    print(f"\nbf16 cuda: eagle2 vs ar token agreement {(ref == out).float().mean():.4f}, "
          f"identical images {int((ref == out).flatten(1).all(1).sum())}/{len(PROMPTS)}")
    for dtype in (torch.float32, torch.bfloat16):
        table = measure_target_cost(bundle.target.to("cuda", dtype), rows=2,
                                    prefix_len=typical_prefix(bundle.make_prompter()))
        print(f"cuda {dtype}: " + ", ".join(f"{n} tok {ms:.2f} ms ({table.ratio(n):.2f}x)" for n, ms in table.ms.items()))


def test_cuda_emoji16_side_by_side(tmp_path):
    """The benchmark on the embedded model on CUDA (fp32 greedy, bf16 at the defaults): every
    lossless method equals `ar` at temperature 0; prints the tables for the closing note."""
    import json

    from jobs import bench

    out = tmp_path / "bench_cuda.json"
    assert bench.main(["--device", "cuda", "--limit", "4", "--methods", "ar,eagle2,adt,adt+cost",
                       "--temperatures", "0", "--json", str(out)]) == 0
    table = json.loads(out.read_text())["tables"]["0"]
    assert all(row["equals_ar"] for row in table.values())
    assert bench.main(["--device", "cuda", "--dtype", "bfloat16", "--limit", "4",
                       "--methods", "ar,eagle2,adt,adt+cost", "--temperatures", "default"]) == 0


def test_cuda_noise_has_the_cpu_bits():
    seeds = torch.tensor([0, 5, 2**62 + 7])
    pos = torch.tensor([[0, 1, 255], [3, 3, 9], [1023, 0, 7]])
    assert torch.equal(uniforms(seeds, pos, 16384), uniforms(seeds.cuda(), pos.cuda(), 16384).cpu())


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_cuda_fp32_coupled_batched_equals_ar_alone(batch):
    bundle = random_bundle(seed=4, vocab=64, grid=(6, 5))
    kw = dict(device="cuda", temperature=1.0, top_k=20, cfg_scale=3.0, dtype="float32")
    alone = [Generator(bundle, DecodeConfig(method="ar", batch_size=1, **kw)).generate([p], [i])[0].tokens
             for i, p in enumerate(PROMPTS)]
    for method in ("ar", "eagle2", "adt", "jacobi"):
        res = Generator(bundle, DecodeConfig(method=method, batch_size=batch, **kw)).generate(PROMPTS, [0, 1, 2, 3])
        assert all(torch.equal(r.tokens, a) for r, a in zip(res, alone)), method


def test_cuda_emoji16_bf16_coupled_agreement_report():
    """Measured, not asserted: how often bf16 coupled speculative output equals bf16 coupled AR."""
    bundle = load_bundle("emoji16")
    prompts = [f"{w} emoji" for w in ("red heart", "smiling face", "pizza", "cat", "tree", "star", "car", "dog")]
    kw = dict(device="cuda", dtype="bfloat16", batch_size=8)
    ref = torch.stack([r.tokens for r in Generator(bundle, DecodeConfig(method="ar", **kw)).generate(prompts, list(range(8)))])
    for method in ("eagle2", "adt"):
        out = torch.stack([r.tokens for r in Generator(bundle, DecodeConfig(method=method, **kw)).generate(prompts, list(range(8)))])
        same = (ref == out).flatten(1)
        first = [int((~r).nonzero()[0]) if not bool(r.all()) else None for r in same]
        print(f"\nbf16 cuda emoji16 coupled {method} vs ar: token agreement {same.float().mean():.4f}, "
              f"identical images {int(same.all(1).sum())}/8, first divergence at {first}")

