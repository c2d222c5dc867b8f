"""Chameleon-family bundles through the Generator, on tiny random checkpoints in the real layouts
(HF target directory + tokenizer.json, LANTERN drafter directory, Meta's vqgan.yaml + vqgan.ckpt;
tests/adt_core/chameleon_fixtures.py).

Lumina: prompt rows of their own lengths (the uncond row starts at image start), an end-of-line
after every image row (square and non-square grids); Anole: BOS + image start as the uncond row,
1024 codes, a forced end. `static`, `eagle2`, `adt` and `adt` + cost equal `ar` token for token in
fp32, greedy and coupled, CFG 1 and 3, batch 1 and 3; `ar` equals a naive decode that feeds every
code AND every forced token at the layout's positions, each row alone.
"""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, load_bundle
from adt_core.bundles.family_bundle import write_family_bundle
from adt_core.calibrate import CostTable

from chameleon_fixtures import HEADS, make_drafter, make_hf_chameleon, make_tokenizer, make_vqgan

PROMPTS = ["an apple", "a dog on the grass", "sun"]
SEEDS = [3, 1, 4]
COSTS = CostTable({1: 1.0, 4: 1.2, 8: 1.5, 16: 2.5, 32: 5.0, 64: 10.0, 128: 20.0}, draft_level_ms=0.2,
                  draft={1: 0.2, 64: 0.4, 256: 1.0})
METHODS = [
    ("static", dict(tree=TreeConfig(depth=3))),
    ("eagle2", dict(tree=TreeConfig(depth=3, top_k=3, budget=8))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="shape", d_max=4, k_max=4, n_max=12))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="cost", d_max=4, k_max=4, n_max=12))),
    ("jacobi", dict(adaptive=AdaptiveConfig(budget="shape", d_max=4, k_max=4, n_max=12))),  # no drafter model
]


def make_bundle(root, layout, width=None, height=None):
    groups = 1 if layout == "lumina" else HEADS  # Lumina's qk-norm is [1, head_dim]
    make_hf_chameleon(root / "target", seed=0, qk_groups=groups if layout == "lumina" else None)
    make_tokenizer(root / "target" / "tokenizer.json")
    make_vqgan(root / "vq", n_embed=8192, attn_type=None)
    make_drafter(root / "drafter", root / "target", qk_groups=groups)
    prompt = {"layout": layout}
    if layout == "lumina":
        prompt.update(width=width, height=height, check_size=False)
    write_family_bundle(root, f"tiny-{layout}", "chameleon", {"target": "target", "drafter": "drafter", "vq": "vq"},
                        prompt)
    bundle = load_bundle(root)
    # a mostly rank-1 head (logit_c ~ a_c * <v, h> plus a little of the random head): the random
    # drafter, which reads its features through this head, then agrees with the target often
    # enough that drafted tokens are accepted, while the codes still depend on the context
    g = torch.Generator().manual_seed(1)
    head = bundle.target.lm_head.weight
    with torch.no_grad():
        a, v = torch.randn(head.shape[0], 1, generator=g), torch.randn(1, head.shape[1], generator=g)
        head.copy_(0.05 * head + a * v)
    return bundle


@pytest.fixture(scope="module")
def lumina(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("lumina"), "lumina", width=64, height=48)  # 3 x 4 codes


@pytest.fixture(scope="module")
def lumina_square(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("lumina_sq"), "lumina", width=48, height=48)  # 3 x 3 codes


@pytest.fixture(scope="module")
def anole(tmp_path_factory):
    return make_bundle(tmp_path_factory.mktemp("anole"), "anole")


def naive_greedy(bundle, prompt, scale, n=None):
    """Each row alone, unpadded: its prompt, then every code and forced token at base + offset."""
    target, layout, vocab = bundle.target, bundle.prompter.layout, bundle.prompter.vocab
    rows = bundle.prompter.rows([prompt], scale != 1.0)
    n = n or layout.num_codes
    caches, logits, lens = [], [], []
    for r in range(rows.rows):
        m = int(rows.lengths[r])
        cache = target.new_cache(1, m + layout.length + 2)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        out, _ = target(torch.arange(m), cache.attn_mask(causal), cache, tokens=rows.tokens[r: r + 1, :m])
        caches.append(cache), logits.append(out[0, -1]), lens.append(m)
    codes, one = [], torch.ones(1, 1, dtype=torch.bool)
    for i in range(n):
        mixed = logits[0] if len(logits) == 1 else logits[1] + scale * (logits[0] - logits[1])
        codes.append(int(mixed.argmax()))
        if i == n - 1:
            break
        feed = [(int(vocab.first_id + codes[-1]), layout.offset(i))]
        feed += [(f, layout.offset(i) + 1 + j) for j, f in enumerate(layout.forced_after(i))]
        for r, cache in enumerate(caches):
            for tok, off in feed:
                out, _ = target(torch.tensor([lens[r] + off]), cache.attn_mask(one), cache, tokens=torch.tensor([[tok]]))
            logits[r] = out[0, -1]
    return torch.tensor(codes)


def run(bundle, method, bs, **kw):
    g = Generator(bundle, DecodeConfig(method=method, batch_size=bs, **kw))
    g.use_costs(COSTS)
    return g.generate(PROMPTS, SEEDS)


def codes(res, n=None):
    return torch.stack([r.tokens.flatten()[:n] for r in res])


def test_lumina_layout_and_rows(lumina):
    p = lumina.prompter
    assert (p.layout.grid_h, p.layout.grid_w) == (3, 4) and p.layout.eol == 8803 and p.layout.end == 8196
    rows = p.rows(PROMPTS, True)
    assert rows.lengths[3:].tolist() == [3, 3, 3]  # uncond: image start + two size tokens
    assert all(int(x) > 3 for x in rows.lengths[:3])


@pytest.mark.parametrize("which", ["lumina", "lumina_square"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_lumina_ar_feeds_every_end_of_line_where_the_layout_puts_it(which, cfg_scale, request):
    bundle = request.getfixturevalue(which)
    with torch.inference_mode():
        ref = torch.stack([naive_greedy(bundle, p, cfg_scale) for p in PROMPTS])
    for bs in (1, 3):
        res = run(bundle, "ar", bs, temperature=0.0, cfg_scale=cfg_scale)
        assert torch.equal(codes(res), ref), bs
    layout, vocab = bundle.prompter.layout, bundle.prompter.vocab
    h, w = layout.grid_h, layout.grid_w
    for r in res:
        assert r.tokens.shape == (h, w)
        f = bundle.vq.downsample_factor
        assert r.image.shape == (h * f, w * f, 3)
        seq = layout.assemble(vocab.to_id(r.tokens.flatten()))
        forced = layout.forced()
        assert torch.equal(seq[len(layout.head):][forced.offsets], forced.ids)
        assert seq[len(layout.head) + w].item() == layout.eol and seq[-1].item() == layout.end


@pytest.mark.parametrize("which", ["lumina", "lumina_square"])
@pytest.mark.parametrize("cfg_scale,temperature", [(1.0, 0.0), (3.0, 0.0), (1.0, 1.0), (3.0, 1.0)])
def test_lumina_speculative_methods_equal_ar(which, cfg_scale, temperature, request):
    bundle = request.getfixturevalue(which)
    kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=3 if temperature else 0)
    ref = codes(run(bundle, "ar", 1, **kw))
    accepted = 0
    for method, extra in METHODS:
        for bs in (1, 3):
            res = run(bundle, method, bs, **kw, **extra)
            assert torch.equal(codes(res), ref), (method, extra, bs)
            accepted += sum(r.stats.accepted_draft_tokens for r in res)
    assert accepted > 0  # the accepted-path code ran


@pytest.mark.parametrize("cfg_scale,temperature", [(1.0, 0.0), (3.0, 0.0), (3.0, 1.0)])
def test_anole_speculative_methods_equal_ar(anole, cfg_scale, temperature):
    kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=3 if temperature else 0, max_tokens=40)
    ref = codes(run(anole, "ar", 1, **kw), 40)
    if temperature == 0.0:
        with torch.inference_mode():
            assert torch.equal(ref, torch.stack([naive_greedy(anole, p, cfg_scale, 40) for p in PROMPTS]))
    for method, extra in METHODS:
        for bs in (1, 3):
            assert torch.equal(codes(run(anole, method, bs, **kw, **extra), 40), ref), (method, extra, bs)


def test_anole_whole_image_ends_with_its_forced_end(anole):
    layout, vocab = anole.prompter.layout, anole.prompter.vocab
    assert (layout.grid_h, layout.grid_w, layout.eol, layout.end) == (32, 32, None, 8196)
    rows = anole.prompter.rows(PROMPTS[:1], True)
    assert rows.tokens[1, : int(rows.lengths[1])].tolist() == [0, 8197]  # uncond: BOS + image start
    # batch 3: the three 1024-code images in one wave, not two (an image does not depend on the batch)
    ar = run(anole, "ar", 3, temperature=1.0, top_k=3, cfg_scale=3.0)
    spec = run(anole, "eagle2", 3, temperature=1.0, top_k=3, cfg_scale=3.0, tree=TreeConfig(depth=3, top_k=3, budget=8))
    assert torch.equal(codes(ar), codes(spec))
    for r in ar:
        assert r.tokens.shape == (32, 32)
        seq = layout.assemble(vocab.to_id(r.tokens.flatten()))
        assert seq[-1].item() == 8196 and seq[0].item() == 8197 and vocab.is_code(seq[1:-1]).all()


def test_cost_budget_measures_a_chameleon_target(lumina):
    """adt + cost measures its own cost table on any family's target and drafter."""
    g = Generator(lumina, DecodeConfig(method="adt", batch_size=2, temperature=1.0, top_k=3, cfg_scale=3.0,
                                       adaptive=AdaptiveConfig(budget="cost", d_max=3, k_max=3, n_max=8)))
    res = g.generate(PROMPTS[:2], SEEDS[:2])
    assert g.cost_table().ms and all(r.stats.estimated_speedup > 0 for r in res)
    assert torch.equal(codes(res), codes(run(lumina, "ar", 2, temperature=1.0, top_k=3, cfg_scale=3.0))[:2])


def test_the_drafter_reads_the_prompt_pairs_of_every_row(lumina):
    """A token family's drafter cache holds (token j + 1, hidden j) for each row's prompt, as EAGLE's does."""
    g = Generator(lumina, DecodeConfig(method="eagle2", batch_size=3, temperature=0.0, cfg_scale=3.0,
                                       tree=TreeConfig(depth=3, top_k=3, budget=8)))
    dec = g.decoder(3)
    rows = lumina.prompter.rows(PROMPTS, True)
    with torch.inference_mode():
        dec.admit([(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS, SEEDS))], rows)
    assert dec.drafter.cache.host.tolist() == (rows.lengths - 1).tolist()
