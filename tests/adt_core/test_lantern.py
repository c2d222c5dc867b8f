"""LANTERN relaxed acceptance: neighbour table, TV bound, delta = 0 exactness."""

import torch

from adt_core.round.lantern import nearest_codes, neighbour_table
from adt_core.round.verify import Relaxation, node_acceptance


def brute_neighbours(cb, k):
    d = torch.cdist(cb, cb)
    d.fill_diagonal_(float("inf"))
    return d.argsort(1)[:, :k]


def test_nearest_codes_match_brute_force_in_chunks():
    cb = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(nearest_codes(cb, 7, chunk=64), brute_neighbours(cb, 7))


def test_neighbour_table_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("ADT_CACHE_DIR", str(tmp_path))
    cb = torch.randn(50, 4)
    a = neighbour_table(cb, 5)
    files = list((tmp_path / "lantern").iterdir())
    assert len(files) == 1
    b = neighbour_table(cb, 5)
    assert torch.equal(a, b) and a.shape == (50, 5)


def output_distribution(p, children, relax):
    """Exact distribution of the committed token at one node under (relaxed) verification."""
    accept, residual = node_acceptance(p, children, relax)
    out = torch.zeros_like(p, dtype=torch.float64)
    reach = 1.0
    for x, a in zip(children, accept):
        out[x] += reach * a
        reach *= 1 - a
    return out + reach * residual.double()


def test_lossless_acceptance_reproduces_p():
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        p = torch.rand(30, generator=g).pow(3).double()
        p /= p.sum()
        kids = torch.randperm(30, generator=g)[:5].tolist()
        assert torch.allclose(output_distribution(p, kids, None), p, atol=1e-9)


def test_lantern_total_variation_bounded_by_delta():
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for trial in range(200):
        v = 40
        p = torch.rand(v, generator=g).pow(4).double()
        p /= p.sum()
        nb = torch.stack([torch.randperm(v, generator=g) for _ in range(v)])
        nb = torch.stack([row[row != i][:12] for i, row in enumerate(nb)])
        delta = [0.05, 0.1, 0.3, 0.5][trial % 4]
        relax = Relaxation(nb, delta=delta)
        kids = torch.randperm(v, generator=g)[: 1 + trial % 6].tolist()
        out = output_distribution(p, kids, relax)
        assert abs(float(out.sum()) - 1) < 1e-9
        tv = 0.5 * float((out - p).abs().sum())
        assert tv <= delta + 1e-9, (trial, tv, delta)
        worst = max(worst, tv / delta)
    assert worst > 0.3  # the relaxation really moved mass


def test_lantern_plus_plus_caps_by_lambda():
    p = torch.tensor([0.1, 0.3, 0.05, 0.05, 0.5], dtype=torch.float64)
    nb = torch.tensor([[2, 3, 1, 4], [0, 2, 3, 4], [3, 0, 1, 4], [2, 0, 1, 4], [1, 0, 2, 3]])
    accept, _ = node_acceptance(p, [0], Relaxation(nb, lam=2.0))  # extra mass <= (2-1) * 0.1
    assert abs(accept[0] - 0.2) < 1e-12  # 0.1 + p[2] + p[3]
    accept, _ = node_acceptance(p, [0], Relaxation(nb, delta=0.0))
    assert abs(accept[0] - 0.1) < 1e-12
