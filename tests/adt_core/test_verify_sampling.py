"""Verification and sampling on hand-built logits."""

import torch

from adt_core.config import SamplingConfig
from adt_core.round.sampling import cfg_mix, target_probs, warp
from adt_core.round.verify import verify_greedy, verify_stochastic
from tree_fixtures import chain_tree


def logits_argmax(rows):
    lg = torch.zeros(len(rows), 8)
    for i, a in enumerate(rows):
        lg[i, a] = 5.0
    return lg


def test_greedy_accepts_longest_matching_path():
    tree = chain_tree()
    res = verify_greedy(tree, 0, logits_argmax([3, 4, 0, 6]))
    assert res.accepted == [1, 3] and res.bonus == 6
    res = verify_greedy(tree, 0, logits_argmax([5, 0, 2, 0]))
    assert res.accepted == [2] and res.bonus == 2
    res = verify_greedy(tree, 0, logits_argmax([7, 0, 0, 0]))
    assert res.accepted == [] and res.bonus == 7


def test_top_p_boundary_as_llamagen():
    """A sorted token is removed only when the mass strictly before it EXCEEDS top_p."""
    lg = torch.log(torch.tensor([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16]))
    p = target_probs(lg, SamplingConfig(temperature=1.0, top_p=0.75))
    assert int((p > 0).sum()) == 3  # mass before the third is exactly 0.75: kept
    p = target_probs(lg, SamplingConfig(temperature=1.0, top_p=0.74))
    assert int((p > 0).sum()) == 2


def test_cfg_mix():
    cond, uncond = torch.randn(2, 5), torch.randn(2, 5)
    out = cfg_mix(torch.cat([cond, uncond]), 3.0)
    assert torch.allclose(out, uncond + 3.0 * (cond - uncond))
    assert cfg_mix(cond, 1.0) is cond


def test_warp_top_k_top_p():
    lg = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = target_probs(lg, SamplingConfig(temperature=1.0, top_k=3))
    assert p[3] == 0 and torch.allclose(p[:3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)
    p = target_probs(lg, SamplingConfig(temperature=1.0, top_p=0.79))
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = target_probs(lg, SamplingConfig(temperature=1.0, top_p=0.81))
    assert p[2] > 0 and p[3] == 0
    hot = warp(lg, SamplingConfig(temperature=2.0))
    assert torch.allclose(hot, lg / 2)


def test_stochastic_one_step_distribution_is_exact():
    """The first committed token after the root follows p exactly, whatever the children."""
    tree = chain_tree()
    lg = torch.randn(4, 8)
    cfg = SamplingConfig(temperature=1.0)
    p = target_probs(lg[0], cfg)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(8)
    n = 20000
    for _ in range(n):
        res = verify_stochastic(tree, 0, lg, cfg, g)
        first = int(tree.tokens[0, res.accepted[0]]) if res.accepted else res.bonus
        counts[first] += 1
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.02, tv


def test_stochastic_is_seeded():
    tree = chain_tree()
    lg = torch.randn(4, 8)
    cfg = SamplingConfig(temperature=1.0)
    a = [verify_stochastic(tree, 0, lg, cfg, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify_stochastic(tree, 0, lg, cfg, torch.Generator().manual_seed(s)) for s in range(20)]
    assert [(r.accepted, r.bonus) for r in a] == [(r.accepted, r.bonus) for r in b]
