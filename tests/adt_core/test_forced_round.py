"""Forced end-of-line tokens in the round (Lumina's layout), on a toy family over a random LlamaGen.

The toy family reserves id 0 (pad) and the last id (end-of-line) of a random LlamaGen target and
makes the ids between them the image codes (code c = id c + 1); its layout puts an end-of-line
after every image row. A naive decode that feeds the whole sequence (codes AND end-of-lines at
the layout's positions, each row alone) must give `ar`'s codes, and every speculative method
`ar`'s codes: so every forced token sits where the layout puts it, in every cache row.
"""

import dataclasses

import pytest
import torch

from adt_core import DecodeConfig, Generator, TreeConfig, random_bundle
from adt_core.families.contract import ImageVocab, Layout
from adt_core.kv_cache import KVCache

from test_contract_round import COSTS, METHODS, PROMPTS, SEEDS, RaggedPrompter

VOCAB = 26  # ids: 0 pad, 1..24 codes, 25 end-of-line


class CodeTarget(torch.nn.Module):
    """A LlamaGen target whose logits keep the code ids only (the contract's logits over codes)."""

    def __init__(self, inner, vocab: ImageVocab) -> None:
        super().__init__()
        self.inner, self.vocab, self.config = inner, vocab, inner.config

    def new_cache(self, *a, **k):
        return self.inner.new_cache(*a, **k)

    def forward(self, positions, mask, cache=None, tokens=None, embeds=None):
        logits, hidden = self.inner(positions, mask, cache, tokens=tokens, embeds=embeds)
        return logits[..., self.vocab.id_slice], hidden

    def head(self, hidden):
        return self.inner.head(hidden)[..., self.vocab.id_slice]


class EolPrompter(RaggedPrompter):
    def __init__(self, bundle, keep, grid):
        super().__init__(bundle, keep)
        self.vocab = ImageVocab(first_id=1, num_codes=VOCAB - 2, vocab_size=VOCAB)
        self.layout = Layout(grid[0], grid[1], eol=VOCAB - 1)


def eol_bundle(grid, seed=31):
    # the random target's grid only sizes its RoPE table: rows + 1 rows of W + 1 cover every position
    inner = random_bundle(seed=seed, vocab=VOCAB, grid=(grid[0] + 1, grid[1] + 1))
    prompter = EolPrompter(inner, 3, grid)
    target = CodeTarget(inner.target, prompter.vocab)
    return dataclasses.replace(inner, target=target, prompter=prompter, grid=grid)


def naive_greedy(bundle, prompt, scale):
    """Each row alone: the prompt, then every code and forced end-of-line at base + offset."""
    target, layout, vocab = bundle.target, bundle.prompter.layout, bundle.prompter.vocab
    rows = bundle.prompter.rows([prompt], scale != 1.0)
    cfg = target.config
    caches, logits, lens = [], [], []
    for r in range(rows.rows):
        m = int(rows.lengths[r])
        cache = KVCache(cfg.n_layer, 1, cfg.n_head, cfg.head_dim, m + layout.length + 4, "cpu", torch.float32)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        out, _ = target(torch.arange(m), cache.attn_mask(causal), cache, embeds=rows.embeds[r: r + 1, :m])
        caches.append(cache), logits.append(out[0, -1]), lens.append(m)
    codes = []
    one = torch.ones(1, 1, dtype=torch.bool)
    for i in range(layout.num_codes):
        mixed = logits[0] if len(logits) == 1 else logits[1] + scale * (logits[0] - logits[1])
        codes.append(int(mixed.argmax()))
        feed = [(vocab.first_id + codes[-1], lens[0] * 0 + layout.offset(i))]
        feed += [(f, layout.offset(i) + 1 + j) for j, f in enumerate(layout.forced_after(i))]
        for r, cache in enumerate(caches):
            for tok, off in feed:
                out, _ = target(torch.tensor([lens[r] + off]), cache.attn_mask(one), cache, tokens=torch.tensor([[tok]]))
            logits[r] = out[0, -1]
    return torch.tensor(codes)


def run(bundle, method, prompts, seeds, **kw):
    g = Generator(bundle, DecodeConfig(method=method, **kw))
    g.use_costs(COSTS)
    return torch.stack([r.tokens.flatten() for r in g.generate(prompts, seeds)])


@pytest.mark.parametrize("grid", [(4, 3), (3, 5)])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_ar_places_every_end_of_line_where_the_layout_puts_it(grid, cfg_scale):
    bundle = eol_bundle(grid)
    with torch.inference_mode():
        ref = torch.stack([naive_greedy(bundle, p, cfg_scale) for p in PROMPTS])
    for bs in (1, 3):
        out = run(bundle, "ar", PROMPTS, SEEDS, batch_size=bs, temperature=0.0, cfg_scale=cfg_scale)
        assert torch.equal(out, ref), bs
    layout = bundle.prompter.layout
    seq = layout.assemble(bundle.prompter.vocab.to_id(out[0]))
    forced = layout.forced()
    assert torch.equal(seq[forced.offsets], forced.ids)
    assert torch.equal(layout.split(seq).flatten(), bundle.prompter.vocab.to_id(out[0]))


@pytest.mark.parametrize("grid", [(4, 3), (3, 5)])
@pytest.mark.parametrize("cfg_scale,temperature", [(1.0, 0.0), (3.0, 0.0), (3.0, 1.0), (1.0, 1.0)])
def test_speculative_methods_equal_ar_across_end_of_lines(grid, cfg_scale, temperature):
    bundle = eol_bundle(grid)
    kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=8 if temperature else 0)
    ref = run(bundle, "ar", PROMPTS, SEEDS, batch_size=1, **kw)
    accepted = 0
    for method, extra in METHODS:
        for bs in (1, 3):
            g = Generator(bundle, DecodeConfig(method=method, batch_size=bs, **kw, **extra))
            g.use_costs(COSTS)
            res = g.generate(PROMPTS, SEEDS)
            out = torch.stack([r.tokens.flatten() for r in res])
            assert torch.equal(out, ref), (method, extra, bs)
            accepted += sum(r.stats.accepted_draft_tokens for r in res)
    assert accepted > 0


def test_images_decode_to_the_layout_grid():
    bundle = eol_bundle((3, 5))
    g = Generator(bundle, DecodeConfig(method="eagle2", temperature=0.0, batch_size=2,
                                       tree=TreeConfig(depth=3, top_k=3, budget=6)))
    g.use_costs(COSTS)
    f = bundle.vq.cfg.downsample_factor
    for r in g.generate(PROMPTS[:2], SEEDS[:2]):
        assert r.tokens.shape == (3, 5) and r.image.shape == (3 * f, 5 * f, 3)
