"""Many images in flight: batch invariance, the ragged cache, continuous refill, failures alone."""

import pytest
import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.results import PromptFailure
from adt_core.round.prefill import prefill_rows

PROMPTS = ["a red apple", "blue dog on grass", "sun", "green frog jumping high", "x y z"]
SEEDS = [3, 14, 15, 92, 65]
# a cost table under which drafting pays on small trees but not on wide ones (deterministic shapes)
COSTS = CostTable({1: 1.0, 4: 1.2, 8: 1.5, 16: 2.5, 32: 5.0, 64: 10.0, 128: 20.0}, draft_level_ms=0.2,
                  draft={1: 0.2, 64: 0.4, 256: 1.0})

METHODS = [
    ("static", dict(tree=TreeConfig(depth=4))),
    ("eagle2", dict(tree=TreeConfig(depth=4, top_k=4, budget=12))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="shape", d_max=5, k_max=6, n_max=16))),
    ("adt", dict(adaptive=AdaptiveConfig(budget="cost", d_max=5, k_max=6, n_max=16))),
    ("jacobi", dict(adaptive=AdaptiveConfig(budget="cost", d_max=5, k_max=6, n_max=16))),  # no drafter model
]


def run(bundle, method, prompts, seeds, **kw):
    g = Generator(bundle, DecodeConfig(method=method, **kw))
    g.use_costs(COSTS)
    return g.generate(prompts, seeds)


@pytest.mark.parametrize("grid,vocab", [((3, 5), 24), ((5, 3), 16)])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("temperature", [0.0, 1.1])
def test_every_image_is_the_image_ar_makes_alone(grid, vocab, cfg_scale, temperature):
    bundle = random_bundle(seed=11, vocab=vocab, grid=grid)
    kw = dict(temperature=temperature, cfg_scale=cfg_scale, top_k=10 if temperature else 0)
    alone = {p: run(bundle, "ar", [p], [s], batch_size=1, **kw)[0].tokens for p, s in zip(PROMPTS, SEEDS)}
    order = [4, 2, 0, 3, 1]
    refilled = False
    for method, extra in [("ar", {})] + METHODS:
        for bs in (1, 3, 8):
            for idx in (range(5), order):
                ps, ss = [PROMPTS[i] for i in idx], [SEEDS[i] for i in idx]
                res = run(bundle, method, ps, ss, batch_size=bs, **kw, **extra)
                for p, r in zip(ps, res):
                    assert torch.equal(r.tokens, alone[p]), (method, extra, bs, p)
                    assert r.stats.batch_size == min(bs, 5)
                if method != "ar" and bs == 3:
                    rounds = [len(r.stats.rounds) for r in res[:3]]
                    refilled |= len(set(rounds)) > 1  # images left at different rounds: refill mid-batch
    assert refilled


def test_stream_yields_as_images_finish_and_in_input_order_from_generate():
    bundle = random_bundle(seed=12, vocab=16, grid=(4, 4))
    g = Generator(bundle, DecodeConfig(method="eagle2", temperature=0.0, batch_size=2,
                                       tree=TreeConfig(depth=3, top_k=3, budget=6)))
    got = list(g.stream(PROMPTS, SEEDS))
    assert sorted(i for i, _ in got) == list(range(5))
    gen = g.generate(PROMPTS, SEEDS)
    for i, r in got:
        assert torch.equal(r.tokens, gen[i].tokens) and r.prompt == PROMPTS[i]


def test_a_failing_prompt_fails_alone():
    bundle = random_bundle(seed=13, vocab=16, grid=(4, 4))
    enc = bundle.text_encoder
    real = enc.encode

    def encode(prompts):
        if any("BAD" in p for p in prompts):
            raise ValueError("cannot encode BAD")
        return real(prompts)

    enc.encode = encode
    prompts = PROMPTS[:2] + ["BAD prompt"] + PROMPTS[2:]
    seeds = SEEDS[:2] + [7] + SEEDS[2:]
    g = Generator(bundle, DecodeConfig(method="adt", temperature=1.0, batch_size=3))
    out = dict(g.stream(prompts, seeds))
    assert isinstance(out[2], PromptFailure) and "cannot encode BAD" in str(out[2].error)
    enc.encode = real
    for i, p in enumerate(prompts):
        if i != 2:
            alone = Generator(bundle, DecodeConfig(method="ar", temperature=1.0, batch_size=1)).generate([p], [seeds[i]])
            assert torch.equal(out[i].tokens, alone[0].tokens)
    with pytest.raises(ValueError, match="cannot encode BAD"):
        enc.encode = encode
        g.generate(prompts, seeds)


def fresh_cache_rows(g, prompt, committed):
    """A single-image cache holding captions + committed[:-1] (the root is not cached yet)."""
    cache = g.bundle.target.new_cache(g.cfg_rows, g.bundle.target.config.cls_token_num + len(committed))
    prefill_rows(g.bundle.target, g.prompter.rows([prompt], g.cfg_rows == 2), cache)
    t = cache.length
    toks = torch.tensor(committed[:-1])[None].repeat(g.cfg_rows, 1)
    if toks.shape[1]:
        causal = torch.ones(toks.shape[1], toks.shape[1], dtype=torch.bool).tril()
        g.bundle.target(torch.arange(t, t + toks.shape[1]), cache.attn_mask(causal), cache, tokens=toks)
    return cache


def assert_same_entries(cache, row, ref, ref_row, n, fixed=0, **tol):
    """Cache row `row`'s first n entries (keys and values, every layer) are `ref` row `ref_row`'s:
    the first `fixed` (the prompt's) in order, the rest in some order (placing a stage may move a
    row's latest entries into its gap; attention sums over keys in any order, each carrying its
    rotated position)."""
    def columns(c, r):  # (n, layers x heads x hd x 2): one vector per entry
        return torch.cat([x[:, r, :, :n].permute(2, 0, 1, 3).reshape(n, -1) for x in (c.k, c.v)], 1)
    got, want = columns(cache, row), columns(ref, ref_row)
    match = torch.cat([torch.arange(fixed), fixed + torch.cdist(got[fixed:], want[fixed:]).argmin(1)])  # (n,)
    assert sorted(match.tolist()) == list(range(n))  # a permutation
    torch.testing.assert_close(got, want[match], **tol)


@pytest.mark.parametrize("method,cfg_scale", [("eagle2", 3.0), ("adt", 1.0), ("ar", 3.0)])
def test_ragged_cache_rows_hold_exactly_the_committed_prefix(method, cfg_scale):
    bundle = random_bundle(seed=14, vocab=16, grid=(4, 5))
    g = Generator(bundle, DecodeConfig(method=method, temperature=0.9, cfg_scale=cfg_scale, batch_size=3,
                                       tree=TreeConfig(depth=3, top_k=3, budget=8)))
    g.use_costs(COSTS)
    dec = g.decoder(3)
    queue = list(zip(range(5), PROMPTS, SEEDS))
    nbytes, t = dec.cache.nbytes(), bundle.target.config.cls_token_num
    done, rounds, narrowed = 0, 0, []
    with torch.inference_mode():
        while queue or dec.active():
            free = len(dec.free())
            if queue and free:
                items, queue = queue[:free], queue[free:]
                done += len(dec.admit(items, g.prompter.rows([p for _, p, _ in items], g.cfg_rows == 2)))
            done += len(dec.step())
            rounds += 1
            if not queue and dec.narrow():  # the tail moves to fewer slots: rows stay exact
                narrowed.append(dec.capacity)
                nbytes = dec.cache.nbytes()
            assert dec.cache.nbytes() == nbytes  # preallocated once: no growth with rounds
            dec.cache.place()  # staged entries (a run of plain steps on ragged rows) at each row's own places
            for b in dec.active():
                count = int(dec.slots.host_count[b])
                committed = dec.slots.tokens[b, :count].tolist()
                ref = fresh_cache_rows(g, dec.meta[b][1], committed)
                n = ref.length
                for j, row in enumerate(b + dec.capacity * i for i in range(g.cfg_rows)):
                    assert int(dec.cache.lengths[row]) == int(dec.cache.host[row]) == t + count - 1 == n
                    assert torch.equal(dec.cache.valid[row, :t], ref.valid[j, :t])
                    assert_same_entries(dec.cache, row, ref, j, n, t, atol=1e-5, rtol=1e-4)  # keys and values
            for b in dec.free():  # retired rows are empty again
                assert all(int(dec.cache.lengths[b + dec.capacity * i]) == 0 for i in range(g.cfg_rows))
    assert done == 5 and rounds > 4
    if method != "ar":  # images left at different rounds: the last ones went on in one slot
        assert narrowed and narrowed[-1] == 1 and dec.cache.k.shape[1] == g.cfg_rows


def test_the_tail_of_a_batch_computes_only_its_images_and_keeps_their_stats(monkeypatch):
    """Once no image will be admitted and at most half the slots are busy, rounds run over the
    next power of two of slots (operator shapes, not time); outputs equal ar's alone."""
    from adt_core.round.decoder import BatchDecoder

    bundle = random_bundle(seed=15, vocab=16, grid=(4, 5))
    g = Generator(bundle, DecodeConfig(method="adt", temperature=0.9, cfg_scale=3.0, batch_size=4,
                                       adaptive=AdaptiveConfig(budget="shape", d_max=4, k_max=4, n_max=12)))
    rows, in_step = [], []
    step, forward = BatchDecoder.step, bundle.target.forward

    def counted_step(self, **kw):
        in_step.append(True)
        try:
            return step(self, **kw)
        finally:
            in_step.pop()

    def counted_forward(positions, mask, cache=None, **kw):
        if in_step:
            rows.append(mask.shape[0])  # mask (R, 1, S, K): the rows this round computes
        return forward(positions, mask, cache, **kw)

    monkeypatch.setattr(BatchDecoder, "step", counted_step)
    monkeypatch.setattr(bundle.target, "forward", counted_forward)
    res = g.generate(PROMPTS, SEEDS)
    for p, s, r in zip(PROMPTS, SEEDS, res):
        alone = Generator(bundle, DecodeConfig(method="ar", temperature=0.9, cfg_scale=3.0)).generate([p], [s])[0]
        assert torch.equal(r.tokens, alone.tokens) and r.stats.batch_size == 4  # telemetry: the batch admitted to
    assert rows[0] == 8 and rows[-1] == 2  # cond + uncond rows of 4 slots; the last image alone
    tail = rows[next(i for i, r in enumerate(rows) if r < 8):]
    assert tail == sorted(tail, reverse=True)  # narrowed only once the queue is empty: never wider again


def test_a_split_wave_waits_briefly_to_refill_together_while_plain_steps_are_ahead():
    """After a probe leaves slots a token apart, free slots wait for the rest of their wave when
    it finishes within HOLD of an image's rounds of idle batch and the planner expects plain
    steps; otherwise (drafting ahead, a long wait, `ar`) they refill at once."""
    from adt_core.round.slot_table import HOLD

    bundle = random_bundle(seed=5, vocab=16, grid=(8, 8))  # 64 tokens: HOLD allows 0.64 rounds of idle batch
    g = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, batch_size=4,
                                       adaptive=AdaptiveConfig(budget="cost")))
    g.use_costs(COSTS)
    d = g.decoder(4)
    items, rows, _ = g._encode([(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS[:4], SEEDS))])
    d.admit(items, rows)
    d.planner.holds = lambda slots: True
    n = d.n
    d.slots.active[0] = False  # one slot finished a round early
    d.slots.host_count[1:] = n - 2  # the others need 2 more rounds: 1/4 idle x 2 = 0.5 <= 0.64
    assert (1 - 3 / 4) * 2 <= HOLD * n and not d.admits_now()
    d.slots.host_count[1:] = n - 3  # 0.75 rounds of idle batch: refill now
    assert d.admits_now()
    d.slots.host_count[1:] = n - 2
    d.planner.holds = lambda slots: False  # drafting ahead: rows stay ragged anyway
    assert d.admits_now()
    ar = Generator(bundle, DecodeConfig(method="ar", temperature=0.0, batch_size=4)).decoder(4)
    ar.admit(items, rows)
    ar.slots.active[0], ar.slots.host_count[1:] = False, n - 2
    assert ar.admits_now()  # ar never waits (its slots finish together unless a prompt failed)


def test_a_split_wave_waits_longer_when_its_spread_would_cost_more_over_the_queue():
    """Split by g tokens, every later wave of plain steps reads g (n - g) keys per cache row more
    than a lockstep batch; merging idles the free slots g steps once, and each busy slot from its
    own end on. Past HOLD the free slots wait when the queue behind them would pay more for the
    spread (`_merge_pays`), never where keys cost nothing (a flat device) or nothing waits."""
    from dataclasses import replace

    bundle = random_bundle(seed=5, vocab=16, grid=(8, 8))
    g = Generator(bundle, DecodeConfig(method="adt", temperature=0.0, batch_size=4,
                                       adaptive=AdaptiveConfig(budget="cost")))
    g.use_costs(replace(COSTS, key_ms=0.001))
    d = g.decoder(4)
    items, rows, _ = g._encode([(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS[:4], SEEDS))])
    d.admit(items, rows)
    d.planner.holds = lambda slots: True
    n, step = d.n, COSTS.cost(4)
    d.slots.active[0] = False
    d.slots.host_count[1:] = n - 20  # 20 rounds to go: 1/4 idle x 20 = 5 rounds, past HOLD
    assert d.admits_now(0)  # nothing waits behind the wave: refill now
    # one free slot idle for a step against waiting x key_ms x cfg rows x 4 slots x (n - 20) keys
    need = step / (0.001 * d.r * 4 * (n - 20))
    assert d.r == 2 and 1 < need < 10 and d.admits_now(int(need)) and not d.admits_now(int(need) + 1)
    d.slots.host_count[2:] = n - 2  # two of the busy slots end much sooner: they idle 18 rounds too
    uneven = step * (20 + 18 + 18) / 4 / (0.001 * d.r * 20 * (n - 20))  # 2.8x the queue
    assert d.admits_now(int(need) + 1) and d.admits_now(int(uneven)) and not d.admits_now(int(uneven) + 1)
    d.slots.host_count[2:] = n - 20
    g.use_costs(replace(COSTS, key_ms=0.0))  # keys cost nothing: the spread is free
    flat = g.decoder(4)
    flat.admit(items, rows)
    flat.planner.holds = lambda slots: True
    flat.slots.active[0], flat.slots.host_count[1:] = False, n - 20
    assert flat.admits_now(10**6)


@pytest.mark.parametrize("method", ["adt", "jacobi"])
def test_while_a_wave_waits_to_refill_its_rounds_are_plain_steps_and_a_due_probe_waits(method):
    """A round run while free slots wait for the rest of their wave (`held`) is a plain step even
    where the planner would draft (a probe now would spread the rows the wait gathers); the next
    round, refilled, drafts. Jacobi's planner holds a wave exactly while its model chooses plain
    steps."""
    bundle = random_bundle(seed=5, vocab=16, grid=(8, 8))
    g = Generator(bundle, DecodeConfig(method=method, temperature=0.0, batch_size=4,
                                       adaptive=AdaptiveConfig(budget="cost")))
    g.use_costs(COSTS)
    d = g.decoder(4)
    items, rows, _ = g._encode([(i, p, s) for i, (p, s) in enumerate(zip(PROMPTS[:4], SEEDS))])
    d.admit(items, rows)
    p, kinds = d.planner, []
    if method == "adt":
        p.guard.worth_drafting = lambda a: True  # a probe is due
    else:
        p._pick = lambda: 4
    p.observe = lambda *a: kinds.append("drafted")
    p.observe_plain = lambda *a: kinds.append("plain")
    d.step(held=True)
    d.step()
    assert kinds == ["plain", "drafted"]
    if method == "jacobi":
        p.base, p.real, p.over = 10.0, 0.01, 0.0  # drafted rounds measured far behind plain steps
        assert p.choice() == 0 and p.holds(3)
        p.real, p.gain, p._gains = None, {w: 8.0 for w in p.widths}, None  # the model rates drafting far ahead
        assert p.choice() > 0 and not p.holds(3)


def test_ragged_keys_count_what_attention_reads_past_a_lockstep_batch():
    """`SlotTable.ragged_keys`: every cache row is read up to the longest row; a lockstep batch
    (ar's) holds its rows at the longest prompt plus the images' mean count. Rows admitted
    together read nothing extra; slots 1 and 2 lagging slot 0 by 4 and 2 entries cost
    rows x (longest - lockstep) keys."""
    import numpy as np

    bundle = random_bundle(seed=14, vocab=16, grid=(4, 5))
    g = Generator(bundle, DecodeConfig(method="adt", cfg_scale=3.0, batch_size=3))
    g.use_costs(COSTS)
    dec = g.decoder(3)
    items = list(zip(range(3), PROMPTS[:3], SEEDS[:3]))
    dec.admit(items, g.prompter.rows(PROMPTS[:3], True))
    full = 6 * (3 - 1) / (3 + 1) * 20 / 2  # 6 rows; 3 slots spread evenly over 20 entries
    assert dec.ragged_keys() == (0.0, full, 6 * dec.cache.length, 6)  # a lockstep batch: its keys, the longest row's
    host = dec.cache.host.copy()
    host += np.tile([6, 2, 4], 2)  # (cond, uncond) rows of slots 0, 1, 2
    dec.cache.set_lengths(host)
    # 6 rows, longest 6 past the prompt, mean 4: 2 keys a row past a lockstep batch's, which reads to the mean
    assert dec.ragged_keys() == (pytest.approx(6 * (6 - 4)), full, pytest.approx(6 * (dec.cache.length - 2)), 6)


def test_a_stage_that_outgrows_the_rows_is_placed_before_the_next_step():
    """A wave waiting for its last image (`admits_now`) empties its longest rows while the stage
    keeps their columns: the lagging row's plain steps then write past its own end, and after
    `max_len - longest` of them the stage would overflow the rows. Before that step the stage is
    placed (each row's entries at its own 0 .. length - 1), and the row runs on to its own end
    with logits equal to its own forward's (fp32, to float rounding)."""
    import numpy as np

    bundle = random_bundle(seed=14, vocab=16, grid=(4, 5))
    t = bundle.target
    cache = t.new_cache(2, 16)
    cache.k.normal_(), cache.v.normal_()
    cache.set_lengths(np.array([12, 4]))
    alone = t.new_cache(1, 16)
    alone.k[:, 0], alone.v[:, 0] = cache.k[:, 1], cache.v[:, 1]
    alone.set_lengths(np.array([4]))
    one = torch.ones(2, 1, 1, dtype=torch.bool)
    for step in range(12):  # row 1 from 4 to 16 entries: the stage, from column 12, would reach 24
        tokens = torch.tensor([[3], [step % 16]])
        pos = torch.tensor([[12 + min(step, 2)], [4 + step]])  # (row 0: padding once emptied)
        with torch.inference_mode():
            a, _ = t(pos, cache.attn_mask(one), cache, tokens=tokens)
            b, _ = t(pos[1:], alone.attn_mask(one[:1]), alone, tokens=tokens[1:])
        torch.testing.assert_close(a[1:], b, atol=1e-5, rtol=1e-5)
        if step == 1:
            cache.set_lengths(np.array([0, 6]))  # row 0's image retired: its rows emptied, the stage stays
            assert cache.length == 14 and cache._nst == 2
        assert cache.length <= cache.max_len
    assert cache.host[1] == 16 and cache.length == 16


def test_plain_steps_on_ragged_rows_stage_their_entries_past_the_longest_row_then_place_them_at_once():
    """Plain steps on rows of different lengths write every row's entry in the column past the
    longest row (a slice: no per-layer indexed copy), and the next plain steps' in the columns after
    it (the stage); each step's mask shows a row its own keys, the stage and itself. An emptied row
    (a retired image) keeps the stage; anything that needs rows in place (here `set_lengths` to new
    lengths) moves the stage to each row's own length in every layer. The cache then holds what
    per-row writes leave, and every step's logits equal each row's own forward at its own length to
    float rounding (fp32: the keys' order in the sum moved). Placed, a row holds exactly its
    entries at 0 .. length - 1 (the latest ones, moved into its gap, out of order)."""
    import numpy as np

    bundle = random_bundle(seed=14, vocab=16, grid=(4, 5))
    t = bundle.target
    lengths = [12, 9, 11, 4]
    cache = t.new_cache(4, 40)
    cache.k.normal_(), cache.v.normal_()
    cache.set_lengths(np.array(lengths))
    refs = []
    for row, n in enumerate(lengths):  # each row alone, at its own length: the reference
        alone = t.new_cache(1, 40)
        alone.k[:, 0], alone.v[:, 0] = cache.k[:, row], cache.v[:, row]
        alone.set_lengths(np.array([n]))
        refs.append(alone)
    one = torch.ones(4, 1, 1, dtype=torch.bool)
    for step, toks in enumerate([[3, 5, 7, 1], [2, 4, 6, 8], [1, 1, 2, 2]]):
        tokens = torch.tensor(toks)[:, None]
        pos = torch.tensor(lengths)[:, None] + step
        mask = cache.attn_mask(one)  # (R, 1, 1, 12 + step + 1)
        if step == 0:  # own keys, then column 12 for every row
            assert mask[:2, 0, 0].tolist() == [[True] * 13, [True] * 9 + [False] * 3 + [True]]
        else:  # own keys, the stage (columns 12 ..) and itself
            assert mask[1, 0, 0].tolist() == [True] * 9 + [False] * 3 + [True] * (step + 1)
        with torch.inference_mode():
            a, _ = t(pos, mask, cache, tokens=tokens)
            for row, ref in enumerate(refs[:4 if step < 2 else 3]):  # (row 3 is emptied after step 1)
                b, _ = t(pos[row:row + 1], ref.attn_mask(one[:1]), ref, tokens=tokens[row:row + 1])
                torch.testing.assert_close(a[row:row + 1], b, atol=1e-5, rtol=1e-5)
        assert cache.length == 13 + step and cache.host[:3].tolist() == [n + step + 1 for n in lengths[:3]]
        if step == 1:
            staged = cache.k[:, 2, :, 12:14].clone()  # row 2's last two entries, staged (L, heads, 2, hd)
            cache.set_lengths(np.array([14, 11, 13, 0]))  # row 3 emptied (retired): the stage stays
            assert cache.length == 14 and torch.equal(cache.k[:, 2, :, 12:14], staged)
    cache.place()  # rows needed in place (a drafted round's mask): each row's stage joins its own entries
    assert cache.length == 15 and cache._nst == 0
    for row in range(3):
        assert_same_entries(cache, row, refs[row], 0, int(cache.host[row]), atol=1e-5, rtol=1e-5)
