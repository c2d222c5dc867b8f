"""The cost planners' cache rows: room for a small tree past an image's end (`plan.ROOM`,
`Extent.room`), and every plan cut to what the rows have left (`plan.fit`, `Slots.room`)."""

from adt_core import AdaptiveConfig, random_bundle
from adt_core.calibrate import CostTable
from adt_core.round.adaptive import AdaptiveGrid

from test_budget import _curves, _planner


def test_cost_planners_rows_hold_room_for_a_small_tree_and_plans_fit_what_is_left():
    """Attention strides over each cache row's whole allocation, so rows sized for a 64-node tree
    past the image made every plain step dearer (~3% at 64 emoji16@32 images). The cost planners'
    rows hold `ROOM` nodes past an image's end; each plan fits the room the rows have left
    (`Slots.room`, set by the decoder every round), which early in an image is any tree."""
    from adt_core import DecodeConfig
    from adt_core.round.jacobi_plan import JacobiPlanner
    from adt_core.round.plan import ROOM, ShapePlanner
    from adt_core.round.planners import extent
    from adt_core.round.state import Slots

    for method in ("adt", "eagle2", "jacobi"):
        e = extent(DecodeConfig(method=method))
        assert (e.nodes, e.room, e.target_len(100)) == (64, ROOM, 100 + ROOM + 2)  # logits for 64, rows for ROOM
    assert ShapePlanner.extent(DecodeConfig()).target_len(100) == 100 + 64 + 2  # the paper's fixed trees: as wide as asked

    flat = CostTable({1: 10.0, 8: 10.0, 64: 10.0, 256: 10.0, 1024: 10.0})
    p = _planner(flat)
    for j, row in enumerate(_curves([[0.9, 0.1], [0.8, 0.05], [0.6, 0.03]] + [[0.3] + [0.01] * 31] * 5), start=1):
        p.curves[j] = row
    p.level_ms, p.drafted = 0.1, 1
    p.guard.verdict[p.guard.bucket(1)] = True  # drafting wins
    slots = Slots.empty(1, 256, "cpu")
    slots.active[:], slots.host_count[:] = True, 10
    assert p.plan(slots).nodes == 64  # verifying is free: the widest tree
    for room, nodes in ((40, 32), (16, 16), (5, 4), (0, None)):
        slots.room = room
        plan = p.plan(slots)
        assert (plan and plan.nodes) == nodes and (plan is None or plan.levels <= plan.nodes)

    cfg = AdaptiveConfig()
    j = JacobiPlanner(256, cfg, AdaptiveGrid(1, (16, 16), cfg), CostTable({1: 10.0, 64: 10.0}), capacity=1)
    j.trying, j.left = 64, 1  # a probe of 64 nodes
    slots.room = 20
    assert j.plan(slots).nodes == 16


def test_trees_near_an_image_end_fit_the_rows_and_images_stay_equal():
    """A launch-bound device's flat costs make EAGLE-2 sized for it want its widest tree every
    round; on a 32-code image every round is within 64 of the end, so every plan is cut to the
    rows' room, and the images equal ar's (fp32, greedy and coupled, CFG on, 3 in flight)."""
    import torch

    from adt_core import DecodeConfig, Generator
    from adt_core.round.plan import ROOM

    bundle = random_bundle(seed=11, vocab=24, grid=(4, 8))
    flat = CostTable({1: 1.0, 4096: 1.0}, draft_level_ms=0.01)
    prompts, seeds = ["an apple", "a dog", "sun", "a red car"], [3, 1, 4, 1]
    for temperature in (0.0, 1.0):
        kw = dict(temperature=temperature, top_k=8 if temperature else 0, cfg_scale=3.0, dtype="float32", batch_size=3)
        ref = Generator(bundle, DecodeConfig(method="ar", **kw)).generate(prompts, seeds)
        for method in ("eagle2", "adt"):
            g = Generator(bundle, DecodeConfig(method=method, **kw))
            g.use_costs(flat)
            d = g.decoder(3)
            assert d.cache.max_len == d.base + 32 + ROOM + 2
            out = g.generate(prompts, seeds)
            assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(out, ref)), (method, temperature)
            nodes = [t.nodes for r in out for t in r.stats.rounds]
            assert max(nodes) <= 32 + ROOM and (method == "adt" or max(nodes) > ROOM)
