"""The round through the model contract: prompt rows of their own lengths (per-row positions).

A prompter over a random LlamaGen bundle drops each caption row's padding (so every cond row
has its own length) and keeps only the last few entries of the uncond row (shorter than cond,
as Lumina's). The engine must place image index i at base[r] + i in each row r: `ar` equals a
naive decode that runs every row alone, and every speculative method equals `ar`.
"""

import dataclasses

import pytest
import torch

from adt_core import DecodeConfig, Generator, random_bundle
from adt_core.families.contract import PromptRows
from adt_core.families.llamagen.prompt import LlamaGenPrompter
from adt_core.kv_cache import KVCache

from test_batch import COSTS, METHODS

PROMPTS = ["a red apple on a table", "blue dog", "smiling sun over the green hills today", "x"]
SEEDS = [4, 8, 15, 16]


class RaggedPrompter:
    """LlamaGen caption rows, each left-aligned to its valid entries; uncond rows keep `keep`."""

    def __init__(self, bundle, keep: int) -> None:
        self.inner = LlamaGenPrompter(bundle.text_encoder, bundle.target, bundle.grid)
        self.layout, self.vocab, self.max_prompt = self.inner.layout, self.inner.vocab, self.inner.max_prompt
        self.typical_prompt = self.inner.typical_prompt
        self.keep = keep

    def rows(self, prompts, cfg):
        full = self.inner.rows(prompts, cfg)
        r, t = full.valid.shape
        n = len(prompts)
        embeds = torch.zeros_like(full.embeds)
        valid = torch.zeros_like(full.valid)
        lengths = torch.zeros(r, dtype=torch.long)
        for i in range(r):
            keep = full.valid[i].clone()
            if i >= n:  # uncond: only its last `keep` entries
                keep[: t - self.keep] = False
            m = int(keep.sum())
            embeds[i, :m] = full.embeds[i, keep]
            valid[i, :m] = True
            lengths[i] = m
        positions = torch.arange(t)[None].expand(r, t).clone()
        return PromptRows(None, embeds, valid, positions, lengths, n)


def ragged_bundle(seed=21, vocab=24, grid=(3, 5), keep=3):
    bundle = random_bundle(seed=seed, vocab=vocab, grid=grid)
    return dataclasses.replace(bundle, prompter=RaggedPrompter(bundle, keep))


def naive_greedy(bundle, prompt, scale):
    """Each row alone, unpadded, at positions 0 .. len - 1 then len + i; greedy CFG."""
    target = bundle.target
    rows = bundle.prompter.rows([prompt], scale != 1.0)
    caches, logits, lens = [], [], []
    for r in range(rows.rows):
        m = int(rows.lengths[r])
        cache = KVCache(target.config.n_layer, 1, target.config.n_head, target.config.head_dim, m + 64, "cpu",
                        torch.float32)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        out, _ = target(torch.arange(m), cache.attn_mask(causal), cache, embeds=rows.embeds[r: r + 1, :m])
        caches.append(cache), logits.append(out[0, -1]), lens.append(m)
    codes = []
    for i in range(bundle.grid[0] * bundle.grid[1]):
        mixed = logits[0] if len(logits) == 1 else logits[1] + scale * (logits[0] - logits[1])
        codes.append(int(mixed.argmax()))
        for r, cache in enumerate(caches):
            one = torch.ones(1, 1, dtype=torch.bool)
            out, _ = target(torch.tensor([lens[r] + i]), cache.attn_mask(one), cache,
                            tokens=torch.tensor([[codes[-1]]]))
            logits[r] = out[0, -1]
    return torch.tensor(codes)


def run(bundle, method, prompts, seeds, **kw):
    g = Generator(bundle, DecodeConfig(method=method, **kw))
    g.use_costs(COSTS)
    return torch.stack([r.tokens.flatten() for r in g.generate(prompts, seeds)])


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_ar_with_ragged_prompt_rows_equals_each_row_decoded_alone(cfg_scale):
    bundle = ragged_bundle()
    rows = bundle.prompter.rows(PROMPTS, True)
    assert len(set(rows.lengths.tolist())) > 2  # cond rows differ, uncond rows are shorter
    with torch.inference_mode():
        ref = torch.stack([naive_greedy(bundle, p, cfg_scale) for p in PROMPTS])
    for bs in (1, 3):
        out = run(bundle, "ar", PROMPTS, SEEDS, batch_size=bs, temperature=0.0, cfg_scale=cfg_scale)
        assert torch.equal(out, ref), bs


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_methods_equal_ar_with_ragged_prompt_rows(cfg_scale, temperature):
    bundle = ragged_bundle()
    kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=8 if temperature else 0)
    ref = run(bundle, "ar", PROMPTS, SEEDS, batch_size=1, **kw)
    for method, extra in METHODS:
        for bs in (1, 3):
            out = run(bundle, method, PROMPTS, SEEDS, batch_size=bs, **kw, **extra)
            assert torch.equal(out, ref), (method, extra, bs)
