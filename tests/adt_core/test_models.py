"""Target / drafter models: RoPE layout, caption zeros, cache == full forward, tree == branches."""

import math

import pytest
import torch

from adt_core.families.layers import apply_rope, build_rope_cache
from adt_core.families.llamagen.drafter import Drafter, DrafterConfig
from adt_core.families.llamagen.model import GPTConfig, LlamaGenGPT
from adt_core.kv_cache import KVCache
from adt_core.round.tree import ancestor_mask_batch


def tiny(grid=(4, 5), cls=6, seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(dim=64, n_layer=2, n_head=4, vocab_size=32, cls_token_num=cls, caption_dim=16,
                    grid_h=grid[0], grid_w=grid[1], multiple_of=32)
    return LlamaGenGPT(cfg).eval()


def caption_batch(b, cls, dim, valid):
    emb = torch.randn(b, cls, dim)
    mask = torch.zeros(b, cls, dtype=torch.bool)
    for i, n in enumerate(valid):
        mask[i, cls - n:] = True
    return emb * mask[..., None], mask


def full_mask(cmask, s_img):
    """Reference mask for one full forward: causal, padded caption keys hidden, diagonal kept."""
    b, t = cmask.shape
    n = t + s_img
    m = torch.ones(n, n, dtype=torch.bool).tril()[None].repeat(b, 1, 1)
    m[:, :, :t] &= cmask[:, None, :]
    m |= torch.eye(n, dtype=torch.bool)
    return m[:, None]


def test_xl_parameter_counts_on_meta():
    with torch.device("meta"):
        m = LlamaGenGPT(GPTConfig.llamagen("XL"))
        d = Drafter(DrafterConfig.for_target(m.config))
    assert sum(p.numel() for p in m.parameters()) == 777_678_080
    assert m.cls_embedding.uncond_embedding.numel() == 245_760
    assert len(m.state_dict()) == 258
    assert m.config.ffn_dim == 3584
    assert sum(p.numel() for p in d.parameters()) == 44_567_040
    assert len(d.state_dict()) == 11


def test_rope_table_is_real_when_built_on_meta():
    """A model built on the meta device and materialised with to_empty (jobs/cost_curves.py's
    XL target) keeps a real RoPE table: it is not a buffer, so to_empty never fills it."""
    with torch.device("meta"):
        m = tiny()
    assert m.rope.table.device.type == "cpu"
    assert torch.equal(m.rope.table, tiny().rope.table)


def test_caption_rows_follow_the_captions_device():
    """The uncond row joins the captions on their device (on CUDA the text encoder's states stay
    on the host while the target sits on the GPU; meta stands in for the other device here)."""
    from adt_core.families.llamagen.prompt import caption_rows

    m = tiny()
    caps = torch.empty(2, 6, 16, device="meta")
    rows = caption_rows(m, caps, torch.ones(2, 6, dtype=torch.bool, device="meta"), cfg=True)
    assert rows.embeds.device.type == "meta" and rows.embeds.shape == (4, 6, 16)


def test_rope_table_layout():
    h, w, cls, hd = 3, 5, 4, 16
    table = build_rope_cache(h, w, cls, hd)
    assert table.shape == (cls + h * w, hd // 2, 2)
    assert torch.all(table[:cls] == 0)
    f = [10000 ** (-2 * i / (hd // 2)) for i in range(hd // 4)]
    r, c = 2, 3
    row = table[cls + r * w + c]
    expect = [r * x for x in f] + [c * x for x in f]
    assert torch.allclose(row[:, 0], torch.tensor([math.cos(a) for a in expect]), atol=1e-6)
    assert torch.allclose(row[:, 1], torch.tensor([math.sin(a) for a in expect]), atol=1e-6)


def test_rope_rotates_interleaved_pairs():
    x = torch.randn(1, 1, 1, 4)
    ang = torch.tensor([0.3, 1.1])
    rope = torch.stack([ang.cos(), ang.sin()], -1)[None, None]  # (1, 1, 2, 2)
    out = apply_rope(x, rope)[0, 0, 0]
    x = x[0, 0, 0]
    for j, a in enumerate(ang):
        a0, a1 = x[2 * j], x[2 * j + 1]
        assert torch.allclose(out[2 * j], a0 * a.cos() - a1 * a.sin(), atol=1e-6)
        assert torch.allclose(out[2 * j + 1], a1 * a.cos() + a0 * a.sin(), atol=1e-6)


def test_caption_positions_have_zero_q_and_k():
    m = tiny()
    t = m.config.cls_token_num
    x = torch.randn(2, t + 3, m.config.dim)
    pos = torch.arange(t + 3)[None].expand(2, -1)
    attn = m.layers[0].attention
    q, k, _ = attn.qkv(x)  # (B, S, heads, hd) each
    rope = m.rope(pos)
    assert torch.all(apply_rope(q, rope)[:, :t] == 0)
    assert torch.all(apply_rope(k, rope)[:, :t] == 0)
    assert torch.any(apply_rope(k, rope)[:, t:] != 0)


@pytest.mark.parametrize("grid", [(4, 5), (3, 3)])
def test_cached_decoding_equals_full_masked_forward(grid):
    m = tiny(grid)
    t, n = m.config.cls_token_num, m.config.num_image_tokens
    cap, cmask = caption_batch(2, t, 16, valid=[2, 6])
    toks = torch.randint(0, 32, (2, n - 1))
    with torch.no_grad():
        full_logits, full_hidden = m(torch.arange(t + n - 1), full_mask(cmask, n - 1), None, tokens=toks, captions=cap)
        cache = m.new_cache(2, t + n)
        cache.valid[:, :t] = cmask
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        lg, hd = m(torch.arange(t), cache.attn_mask(causal), cache, captions=cap)
        steps_l, steps_h = [lg], [hd]
        one = torch.ones(1, 1, dtype=torch.bool)
        for i in range(n - 1):
            lg, hd = m(torch.tensor([t + i]), cache.attn_mask(one), cache, tokens=toks[:, i:i + 1])
            steps_l.append(lg)
            steps_h.append(hd)
    assert cache.length == t + n - 1
    assert torch.allclose(torch.cat(steps_l, 1), full_logits, atol=1e-4)
    assert torch.allclose(torch.cat(steps_h, 1), full_hidden, atol=1e-5)


def test_tree_masked_forward_equals_each_branch_alone():
    m = tiny((4, 4))
    t = m.config.cls_token_num
    cap, cmask = caption_batch(1, t, 16, valid=[4])
    prefix = torch.randint(0, 32, (1, 3))
    # root + a tree: 1,2 under root; 3 under 1; 4,5 under 3; 6 under 2
    parents = torch.tensor([-1, 0, 0, 1, 3, 3, 2])
    tokens, depths = torch.randint(0, 32, (7,)), torch.tensor([0, 1, 1, 2, 3, 3, 2])
    with torch.no_grad():
        cache = m.new_cache(1, 64)
        cache.valid[:, :t] = cmask
        m(torch.arange(t), cache.attn_mask(torch.ones(t, t, dtype=torch.bool).tril()), cache, captions=cap)
        m(torch.arange(t, t + 3), cache.attn_mask(torch.ones(3, 3, dtype=torch.bool).tril()), cache, tokens=prefix)
        base = cache.length
        tree_logits, _ = m(t + 3 + depths, cache.attn_mask(ancestor_mask_batch(parents[None], 3)[0]), cache,
                           tokens=tokens[None])
        for node in range(7):
            path, i = [], node
            while i >= 0:
                path.append(i)
                i = int(parents[i])
            path = path[::-1]
            cache.truncate(base)
            toks = tokens[path][None]
            n = len(path)
            lg, _ = m(torch.arange(t + 3, t + 3 + n), cache.attn_mask(torch.ones(n, n, dtype=torch.bool).tril()),
                      cache, tokens=toks)
            assert torch.allclose(lg[0, -1], tree_logits[0, node], atol=1e-4), node


def test_drafter_runs_with_cache_and_tree_mask():
    m = tiny()
    d = Drafter(DrafterConfig.for_target(m.config)).eval()
    t = m.config.cls_token_num
    cache = d.new_cache(2, 20)
    toks = torch.randint(0, 32, (2, 3))
    hid = torch.randn(2, 3, 64)
    with torch.no_grad():
        f_full = d(toks, hid, torch.arange(t, t + 3), cache.attn_mask(torch.ones(3, 3, dtype=torch.bool).tril()), cache)
        cache.truncate(0)
        f1 = d(toks[:, :2], hid[:, :2], torch.arange(t, t + 2), cache.attn_mask(torch.ones(2, 2, dtype=torch.bool).tril()), cache)
        f2 = d(toks[:, 2:], hid[:, 2:], torch.arange(t + 2, t + 3), cache.attn_mask(torch.ones(1, 1, dtype=torch.bool)), cache)
    assert torch.allclose(torch.cat([f1, f2], 1), f_full, atol=1e-5)
    assert m.head(f_full).shape == (2, 3, 32)
