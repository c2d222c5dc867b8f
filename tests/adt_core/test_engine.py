"""Generator: speculative greedy == vanilla greedy; stochastic path is lossless; seeding."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from adt_core import AdaptiveConfig, DecodeConfig, Generator, SamplingConfig, TreeConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.engine import _COSTS
from adt_core.round.sampling import cfg_mix, target_probs

PROMPTS = ["a red apple on a table", "blue dog", "smiling sun over hills"]

TREES = [
    ("eagle2", TreeConfig(depth=5, top_k=10, budget=58)),
    ("eagle2", TreeConfig(depth=3, top_k=4, budget=12)),
    ("eagle2", TreeConfig(depth=6, top_k=2, budget=8)),
    ("static", TreeConfig(depth=5)),
    ("static", TreeConfig(depth=3, static_paths=((0,), (1,), (0, 0), (0, 0, 0)))),
]


def tokens_of(bundle, method, tree=TreeConfig(), **kw):
    g = Generator(bundle, DecodeConfig(method=method, tree=tree, **kw))
    res = g.generate(PROMPTS, [0, 1, 2])
    return torch.stack([r.tokens for r in res]), res


@pytest.mark.parametrize("grid,vocab", [((4, 4), 16), ((3, 6), 64), ((6, 3), 12)])
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_speculative_equals_vanilla(grid, vocab, cfg_scale):
    bundle = random_bundle(seed=1, vocab=vocab, grid=grid)
    ref, _ = tokens_of(bundle, "ar", temperature=0.0, cfg_scale=cfg_scale)
    accepted = 0
    for method, tree in TREES:
        out, res = tokens_of(bundle, method, tree, temperature=0.0, cfg_scale=cfg_scale)
        assert torch.equal(out, ref), (method, tree)
        accepted += sum(r.stats.accepted_draft_tokens for r in res)
        for r in res:
            s = r.stats
            assert s.target_forwards == 1 + s.num_spec_steps
            assert sum(s.accepted_lengths) == s.accepted_draft_tokens
            assert s.num_spec_steps + s.accepted_draft_tokens + 1 == grid[0] * grid[1]
    assert accepted > 0  # the accepted-path code ran


def test_ar_batch_equals_single():
    bundle = random_bundle(seed=2, vocab=32, grid=(4, 4))
    g = Generator(bundle, DecodeConfig(method="ar", temperature=1.0, top_k=10, cfg_scale=3.0))
    batch = g.generate(PROMPTS, [5, 6, 7])
    single = [g.generate([p], [s])[0] for p, s in zip(PROMPTS, [5, 6, 7])]
    for a, b in zip(batch, single):
        assert torch.equal(a.tokens, b.tokens)


def test_images_are_decoded_one_at_a_time_and_equal_across_batch_sizes(monkeypatch):
    """A wave that finishes together is VQ-decoded image by image: the memory plan holds one
    image's decode, and a decoder's convolutions are not batch-invariant, so decoding a wave
    together would make an image's bytes depend on the images beside it."""
    bundle = random_bundle(seed=2, vocab=32, grid=(4, 4))
    sizes = []
    decode = type(bundle.vq).decode
    monkeypatch.setattr(type(bundle.vq), "decode", lambda self, t: sizes.append(t.shape[0]) or decode(self, t))
    g = Generator(bundle, DecodeConfig(method="ar", batch_size=3, temperature=1.0, top_k=10, cfg_scale=3.0))
    batch = g.generate(PROMPTS, [5, 6, 7])  # one wave of three, finishing in the same round
    assert sizes == [1, 1, 1]
    one = Generator(bundle, DecodeConfig(method="eagle2", batch_size=1, temperature=1.0, top_k=10, cfg_scale=3.0))
    for a, b in zip(batch, one.generate(PROMPTS, [5, 6, 7])):
        assert torch.equal(a.tokens, b.tokens) and np.array_equal(a.image, b.image)


def test_prompts_are_encoded_a_batch_at_a_time_while_slots_refill_one_by_one():
    """Slots of a drafting method finish at different rounds and refill a few at a time; the
    prompts are still encoded `batch_size` at once (the encoder's cost per prompt falls with
    its batch), and every image is the one `ar` makes."""
    bundle = random_bundle(seed=2, vocab=32, grid=(4, 4))
    prompts, seeds = [f"{w} {i}" for i, w in enumerate(PROMPTS * 4)][:10], list(range(10))
    ref = Generator(bundle, DecodeConfig(method="ar", temperature=0.0, batch_size=4)).generate(prompts, seeds)
    g = Generator(bundle, DecodeConfig(method="eagle2", temperature=0.0, batch_size=4))
    encoded, admitted = [], []
    rows, admit = g.prompter.rows, None

    def counted_rows(ps, cfg):
        encoded.append(len(ps))
        return rows(ps, cfg)

    g.prompter.rows = counted_rows
    make = g.decoder

    def decoder(capacity):
        d = make(capacity)
        inner = d.admit
        d.admit = lambda items, part, *a: admitted.append(len(items)) or inner(items, part, *a)
        return d

    g.decoder = decoder
    out = g.generate(prompts, seeds)
    assert encoded == [4, 4, 2] and sum(admitted) == 10 and len(admitted) > 3  # refilled in smaller groups
    for a, b in zip(ref, out):
        assert torch.equal(a.tokens, b.tokens)


def test_prompt_rows_of_some_images_are_those_images_encoded_alone():
    from adt_core.families.contract import token_rows

    cond, uncond = [[5, 6, 7], [8], [9, 10, 11, 12]], [[1, 2], [1], [1, 2, 3]]
    whole = token_rows(cond + uncond, 3)
    for start, stop in ((0, 1), (1, 2), (0, 2), (1, 3)):
        part, alone = whole.select(start, stop), token_rows(cond[start:stop] + uncond[start:stop], stop - start)
        assert part.images == alone.images and part.cfg
        for f in ("tokens", "valid", "positions", "lengths"):
            assert torch.equal(getattr(part, f), getattr(alone, f)), (start, stop, f)


@pytest.mark.parametrize("method", ["ar", "eagle2", "static"])
def test_same_seed_same_image(method):
    bundle = random_bundle(seed=3, vocab=32, grid=(4, 4))
    g = Generator(bundle, DecodeConfig(method=method, temperature=1.0, top_p=0.9, cfg_scale=2.0))
    a = g.generate(PROMPTS[:2], [11, 12])
    b = g.generate(PROMPTS[:2], [11, 12])
    for x, y in zip(a, b):
        assert torch.equal(x.tokens, y.tokens)
        assert np.array_equal(x.image, y.image)
        assert x.image.dtype == np.uint8 and x.image.shape[2] == 3


def test_result_shapes_non_square():
    bundle = random_bundle(seed=4, vocab=32, grid=(3, 5))
    r = Generator(bundle, DecodeConfig(method="eagle2", temperature=0.0)).generate(["x"], [0])[0]
    f = bundle.vq.downsample_factor
    assert r.tokens.shape == (3, 5) and r.tokens.dtype == torch.long
    assert r.image.shape == (3 * f, 5 * f, 3)


def exact_joint(bundle, prompt, sampling, n_tok):
    """p(x_0 .. x_{n-1}) for every sequence, by one full forward over all prefixes (no cache)."""
    target = bundle.target
    v = target.config.vocab_size
    t = target.config.cls_token_num
    seqs = torch.cartesian_prod(*[torch.arange(v)] * (n_tok - 1)) if n_tok > 2 else torch.arange(v)[:, None]
    m = seqs.shape[0]
    cap, cmask = bundle.text_encoder.encode([prompt] * m)
    rows = 2 if sampling.use_cfg else 1
    if rows == 2:
        unc = target.cls_embedding.uncond_embedding.expand_as(cap)
        cap, cmask, toks = torch.cat([cap, unc]), torch.cat([cmask, cmask]), torch.cat([seqs, seqs])
    else:
        toks = seqs
    n = t + n_tok - 1
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None].repeat(cap.shape[0], 1, 1)
    mask[:, :, :t] &= cmask[:, None]
    mask |= torch.eye(n, dtype=torch.bool)
    with torch.no_grad():
        logits, _ = target(torch.arange(n), mask[:, None], None, tokens=toks, captions=cap)
    probs = target_probs(cfg_mix(logits[:, t - 1:], sampling.cfg_scale), sampling)  # (m, n_tok, V)
    joint = torch.ones(m, v, dtype=torch.float64)
    for j in range(n_tok - 1):
        joint *= probs[torch.arange(m), j, seqs[:, j]].double()[:, None]
    joint *= probs[:, n_tok - 1].double()
    return joint.reshape([v] * n_tok)  # index = (x_0, ..., x_{n-1})


def sample_counts(bundle, decode, n_tok, n_samples, prompt):
    g = Generator(bundle, decode)
    res = g.generate([prompt] * n_samples, list(range(n_samples)))
    v = bundle.target.config.vocab_size
    counts = torch.zeros([v] * n_tok, dtype=torch.float64)
    for r in res:
        counts[tuple(r.tokens.flatten()[:n_tok].tolist())] += 1
    return counts, res


def marginal_chi2(counts, probs, dims):
    keep = [d for d in range(counts.dim()) if d not in dims]
    c = counts.sum(dim=keep).flatten() if keep else counts.flatten()
    p = probs.sum(dim=keep).flatten() if keep else probs.flatten()
    # pool cells with expected count < 5 into one, as chi-square requires
    exp = p * c.sum()
    small = exp < 5
    obs_f = torch.cat([c[~small], c[small].sum()[None]]).numpy()
    exp_f = torch.cat([exp[~small], exp[small].sum()[None]]).numpy()
    if exp_f[-1] == 0:
        obs_f, exp_f = obs_f[:-1], exp_f[:-1]
    exp_f = exp_f * obs_f.sum() / exp_f.sum()
    return chisquare(obs_f, exp_f).pvalue


SAMPLING = SamplingConfig(temperature=1.4, top_k=6, top_p=0.92, cfg_scale=2.0)


ADT_SMALL = dict(d0=3, k0=3, d_min=1, d_max=3, k_min=2, k_max=4, n_min=2, n_max=8)


@pytest.mark.parametrize("sampler", ["coupled", "rejection"])
@pytest.mark.parametrize("method,tree,adaptive", [
    ("eagle2", TreeConfig(depth=3, top_k=3, budget=8), AdaptiveConfig()),
    ("static", TreeConfig(depth=3, static_paths=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0))), AdaptiveConfig()),
    ("adt", TreeConfig(), AdaptiveConfig(budget="shape", **ADT_SMALL)),
    ("adt", TreeConfig(), AdaptiveConfig(**ADT_SMALL, init="both", budget="cost")),
    ("jacobi", TreeConfig(), AdaptiveConfig(budget="shape", **ADT_SMALL)),  # rejection: SJD's rule on q-drawn chains
    ("ar", TreeConfig(), AdaptiveConfig()),
])
def test_stochastic_decoding_is_lossless(method, tree, adaptive, sampler, monkeypatch):
    """The joint of the first 4 tokens matches the exact target distribution, under both samplers
    (coupled: one seed per sample, so this is the law of the coupled AR sampler too).

    Chi-square goodness of fit on the (x1, x2) and (x2, x3) marginals (drafted and bonus tokens
    of the first round) and on x0 x x1; each must have p-value > 1e-3. The seeds are fixed, so
    the outcome is deterministic on a given platform.
    """
    bundle = random_bundle(seed=5, vocab=8, grid=(2, 2))
    with torch.no_grad():
        bundle.target.output.weight.mul_(0.35)  # flatter p: more mass off the argmax
    prompt = "green frog"
    s = SAMPLING
    decode = DecodeConfig(method=method, tree=tree, adaptive=adaptive, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, cfg_scale=s.cfg_scale, sampler=sampler)
    if adaptive.budget == "cost":  # a fixed cost table keeps the tree shapes (and the test) deterministic
        from adt_core.round.budget import BatchBudget

        monkeypatch.setattr(BatchBudget, "worth_drafting", lambda self, a: True)  # draft every round
        monkeypatch.setattr("adt_core.round.cost_plan.VETO", 0.0)  # whatever the model expects
        _COSTS[bundle.target] = {("cpu", "float32", 2, decode.batch_size): CostTable(
            {1: 10.0, 8: 10.5, 16: 11.0, 32: 12.0, 64: 14.0, 128: 20.0}, draft_level_ms=0.5)}  # drafting pays
    probs = exact_joint(bundle, prompt, s, 4)
    counts, res = sample_counts(bundle, decode, 4, 1500, prompt)
    for dims in [(1, 2), (2, 3), (0, 1)]:
        pval = marginal_chi2(counts, probs, dims)
        assert pval > 1e-3, (dims, pval)
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum()
    assert tv < 0.15, tv
    if method != "ar":
        assert sum(r.stats.accepted_draft_tokens for r in res) > 50  # speculation really happened


@pytest.mark.parametrize("sampler", ["coupled", "rejection"])
def test_chi2_detects_a_biased_sampler(sampler):
    """Power check for the test above: samples at a wrong temperature are rejected."""
    bundle = random_bundle(seed=5, vocab=8, grid=(2, 2))
    with torch.no_grad():
        bundle.target.output.weight.mul_(0.35)
    s = SAMPLING
    probs = exact_joint(bundle, "green frog", s, 4)
    hotter = DecodeConfig(method="ar", temperature=1.0, top_k=s.top_k, top_p=s.top_p, cfg_scale=s.cfg_scale,
                          sampler=sampler)
    counts, _ = sample_counts(bundle, hotter, 4, 3000, "green frog")
    assert min(marginal_chi2(counts, probs, d) for d in [(1, 2), (2, 3), (0, 1)]) < 1e-3


def test_bf16_greedy_matches_mostly():
    """bf16 rounding may flip near-ties; measure how often the spec output departs from AR."""
    bundle = random_bundle(seed=6, vocab=64, grid=(6, 6))
    ref, _ = tokens_of(bundle, "ar", temperature=0.0, cfg_scale=3.0, dtype="bfloat16")
    out, _ = tokens_of(bundle, "eagle2", TreeConfig(depth=4, top_k=6, budget=20), temperature=0.0, cfg_scale=3.0,
                       dtype="bfloat16")
    same = (ref == out).float().mean().item()
    print(f"bf16 eagle2 vs ar token agreement: {same:.3f}")
    assert same > 0.5


def test_lantern_style_caption_pairs_drafter_is_exact():
    import dataclasses

    from adt_core.families.llamagen.drafter import Drafter

    bundle = random_bundle(seed=9, vocab=16, grid=(4, 4))
    bundle.drafter = Drafter(dataclasses.replace(bundle.drafter.config, caption_pairs=True)).eval()
    ref, _ = tokens_of(bundle, "ar", temperature=0.0, cfg_scale=3.0)
    out, res = tokens_of(bundle, "eagle2", TreeConfig(depth=4, top_k=4, budget=16), temperature=0.0, cfg_scale=3.0)
    assert torch.equal(out, ref)
    assert res[0].stats.draft_forwards > 0
