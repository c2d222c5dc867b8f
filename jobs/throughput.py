"""Throughput benchmark (`python -m jobs.bench --throughput`): images/s per method and batch size.

Every cell decodes the same prompts and seeds (the prompt file, cycled with new seeds when a
batch needs more images) with one Generator holding `batch` images in flight, after a
warm-up that also pays one-off costs (cost-table calibration, neighbour tables, the full batch's
KV caches: `Generator.reserve`). The methods of one batch size run together, one round of each
in turn, each round's time charged to its method (`run_together`): a shared VM's speed drifts by
tens of percent over seconds, and methods run one after the other would each meet a different
machine; each cycle takes them in a seeded random order (a fixed one gave each method the same
place and predecessor throughout). Two passes (the second with the list reversed), each method
keeping its faster one; `--control` adds `ar'`, ar timed
as a method of its own, whose ratio to ar is what the instrument cannot resolve. Reported per
temperature: images/s, the ratio to `ar` at the same batch size and to the best `ar` cell,
whether every image equals `ar`'s (greedy and coupled sampling promise it), mean acceptance
length and nodes per round, a full batch's plain step's ms per image over `ar`'s (what drafted
rounds cost the plain steps after them: the rows' spread, bookkeeping) and the batch's occupancy
(busy slots per round: the rounds a wave's early finishers left partly empty), for the
cost budget its ceiling (the tree its planner rates best at
the verify costs, draft-level ms and acceptance per depth it measured, as a multiple of a plain
step's rate: what a round with free bookkeeping would reach), and the compute floor: model FLOPs per image over the measured
matmul FLOP/s of this device (what a perfectly efficient AR decoder could reach).

Cells are written to the JSON file as they finish; a rerun with the same file skips them.
`--clock cpu` divides by the process's CPU seconds instead of wall seconds: on a CPU shared with
other work (a busy CI runner, other tenants' cgroups) that counts only this engine's own work.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from adt_core import AdaptiveConfig, DecodeConfig, Generator, TreeConfig
from adt_core.bundles.bundle import Bundle
from adt_core.bundles.deepen import describe
from adt_core.results import PromptFailure

METHODS = {
    "ar": dict(method="ar"),
    "eagle2": dict(method="eagle2"),  # its default: the tree sized for this device (eagle2@5x10x58: the paper's)
    "adt": dict(method="adt", adaptive=AdaptiveConfig(budget="cost")),
    "jacobi": dict(method="jacobi", adaptive=AdaptiveConfig(budget="cost")),  # no drafter model
}


def spec_for(method: str) -> dict | None:
    """A method's DecodeConfig fields: one of METHODS, "eagle2@DxKxN" (an EAGLE-2 tree of
    depth D, top-k K, N kept nodes) or "jacobi@N" (Jacobi trees of ADT-Tree's shapes, N nodes
    every round: the shape budget with n_min = n_max = N): hand-sized trees the defaults are
    compared with."""
    name = method.rstrip("'")
    if name in METHODS:
        return METHODS[name]
    if name.startswith("eagle2@"):
        d, k, n = (int(x) for x in name[len("eagle2@"):].split("x"))
        return dict(method="eagle2", tree=TreeConfig(depth=d, top_k=k, budget=n))
    if name.startswith("jacobi@"):
        n = int(name[len("jacobi@"):])
        return dict(method="jacobi", adaptive=AdaptiveConfig(budget="shape", n_min=n, n_max=n))
    return None


def matmul_flops(device: str, dim: int, dtype=torch.float32, rows: int = 2048, repeats: int = 5) -> float:
    """Measured FLOP/s of a (rows x dim) @ (dim x 4 dim) matmul, the shape of a wide forward."""
    a = torch.randn(rows, dim, device=device, dtype=dtype)
    b = torch.randn(dim, 4 * dim, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(2):
        a @ b
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * rows * dim * 4 * dim / statistics.median(times)


def flops_per_image(bundle: Bundle, cfg_rows: int) -> float:
    """Forward FLOPs of AR decoding one image: 2 x weights (embeddings excluded) per token per
    row, plus attention over the growing prefix (2 x 2 x dim per key, all layers)."""
    t = bundle.target
    c = t.config
    weights = sum(p.numel() for n, p in t.named_parameters() if "tok_embeddings" not in n and "cls_embedding" not in n)
    n = c.num_image_tokens
    mean_keys = c.cls_token_num + n / 2
    per_token = 2 * weights + 4 * c.dim * mean_keys * c.n_layer
    return cfg_rows * n * per_token


def cell_images(batch: int, minimum: int) -> int:
    """Images per cell: enough that the batch stays full and refills (4 x B, 2 x B at 64 and
    more), and at least `minimum`."""
    return max(minimum, 4 * batch if batch < 64 else 2 * batch)


def level_ms(rounds) -> float:
    """Draft milliseconds per level of the drafted rounds: each image's trace holds its share of
    the round's draft time and its tree's depth, so the sums give round time / mean depth."""
    drafted = [r for r in rounds if r.nodes]
    levels = sum(r.depth / r.slots for r in drafted)
    return sum(r.draft_ms for r in drafted) / levels if levels else 0.0


def plain_ms(stats, batch: int) -> float:
    """Wall ms per image of a plain step with all `batch` slots busy (each image holds its share of
    a round's time): set beside `ar`'s, what drafted rounds cost the plain steps around them (the
    rows' spread, bookkeeping); a wave's emptier last rounds are `occupancy`'s. Rounds come from
    the images' traces (a plain step: no draft time, no nodes); an untraced method (`ar`, whose
    waves step in lockstep) counts all its plain steps. 0.0 when no such round ran."""
    rounds = [r for s in stats for r in s.rounds if not r.nodes and not r.draft_ms and r.slots == batch]
    if rounds:
        return sum(r.verify_ms for r in rounds) / len(rounds)
    if any(s.rounds for s in stats):
        return 0.0
    n = sum(s.plain_rounds for s in stats)
    return sum(s.plain_ms for s in stats) / n if n else 0.0


def occupancy(stats, batch: int) -> float | None:
    """Images per round over `batch`, over every round (a round of a images appears in a images'
    traces: it counts 1 / a in each). Below 1.0: rounds with fewer images than the batch (a wave
    waiting for its slowest image with its early finishers' slots empty; a narrowed tail, which
    computes fewer slots). None for an untraced method (`ar`)."""
    traces = [s.rounds for s in stats if s.rounds]
    if not traces:
        return None
    rounds = sum(1.0 / r.slots for t in traces for r in t)
    return sum(len(t) for t in traces) / (rounds * batch) if rounds else None


def workload(prompts: list[str], seeds: list[int], count: int) -> tuple[list[str], list[int]]:
    ps = [prompts[i % len(prompts)] for i in range(count)]
    ss = [seeds[i % len(seeds)] + 1000 * (i // len(seeds)) for i in range(count)]
    return ps, ss


def make_generator(bundle: Bundle, spec: dict, temperature, batch: int, prompts, seeds, device, dtype) -> Generator:
    kw = dict(spec, batch_size=batch, device=device, dtype=dtype)
    if temperature is not None:
        kw["temperature"] = temperature
    gen = Generator(bundle, DecodeConfig(**kw))
    gen.generate(prompts[: min(batch, 4)], seeds[: min(batch, 4)])  # warm-up + calibration
    gen.reserve(batch)  # the full batch's caches, made before the clock runs (first touch: 7 s at the stand-in's B 64)
    return gen


def run_together(gens: dict[str, Generator], prompts, seeds, clock: str = "wall",
                 order_seed: int | None = 0) -> dict[str, dict]:
    """Decode the workload with every Generator at once, one round of each in turn: a round's
    wall and CPU time is charged to its method, so a drift in the machine's speed (other
    tenants, frequency) lands on all methods alike instead of on whichever ran then. Each cycle
    takes the methods in a new order (a permutation drawn from `order_seed`; None: as given), so
    every method takes every place and follows every other alike. With a fixed order, `ar` and
    `ar'` (the same code) read 0.824 and 0.775 images/s first and last at the stand-in's B 64 on
    a CPU; shuffled, `ar'` still read 1.07-1.08x of `ar`, so the place was not the whole cause
    (docs/adt_tree.md "Where it stands")."""
    its = {m: g.rounds(prompts, seeds) for m, g in gens.items()}
    wall, cpu = dict.fromkeys(gens, 0.0), dict.fromkeys(gens, 0.0)
    results: dict[str, list] = {m: [None] * len(prompts) for m in gens}
    live = list(gens)
    rng = None if order_seed is None else random.Random(order_seed)
    while live:
        cycle = list(live) if rng is None else rng.sample(live, len(live))
        for m in cycle:
            t0, c0 = time.perf_counter(), time.process_time()
            done = next(its[m], None)
            wall[m] += time.perf_counter() - t0
            cpu[m] += time.process_time() - c0
            if done is None:
                live.remove(m)
                continue
            for i, r in done:
                if isinstance(r, PromptFailure):
                    raise r.error
                results[m][i] = r
    return {m: summarise(gens[m], results[m], wall[m], cpu[m], clock) for m in gens}


def summarise(gen: Generator, res: list, wall: float, cpu: float, clock: str) -> dict:
    st = [r.stats for r in res]
    batch = min(gen.config.batch_size, len(res))  # the decoder's slots (`Generator.rounds`)
    rounds = [x for s in st for x in s.rounds]
    return {
        "images": len(res), "wall_s": wall, "cpu_s": cpu, "clock": clock,
        "images_per_s": len(res) / (wall if clock == "wall" else cpu),
        "mean_acceptance_length": statistics.mean(s.mean_acceptance_length for s in st),
        "nodes_per_round": statistics.mean(r.nodes for r in rounds) if rounds else 0.0,
        "draft_rounds_share": (sum(1 for r in rounds if r.nodes) / len(rounds)) if rounds else 0.0,
        "draft_ms_per_level": level_ms(rounds),
        "plain_ms_per_image_step": plain_ms(st, batch),
        "occupancy": occupancy(st, batch),
        "sampler": getattr(gen.sampler, "kind", gen.sampler), "tokens": [r.tokens.flatten().tolist() for r in res],
        "ceiling": ceiling(gen),
    }


def ceiling(gen: Generator) -> dict | None:
    """The cost table's ceiling for a cost-budget method's fullest batch: the tree its planner
    rates best at what it measured (verify cost per width, draft ms per level, acceptance per
    depth) and that rate over a plain step's, bookkeeping not counted, with what it was rated on
    (the cost table, draft ms per level), the measured bookkeeping, and the model checked out of
    sample (`forecast`: the tokens and ms it expected of each drafted round it sized, before the
    round ran, against what the round committed and cost); None for other methods."""
    planners = {c: p for c, p in gen._planners.items() if hasattr(p, "ceiling")}
    if not planners:
        return None
    p = planners[max(planners)]
    d, m, x = p.ceiling()
    return {"levels": d, "nodes": m, "x_plain": x, "table": json.loads(p.costs.to_json()),
            "level_ms": p.level_ms, "over_ms": p.over, "plain_over_ms": p.plain_over,
            "accepted": {d: round(float(c[-1]), 3) for d, c in sorted(p.curves.items())},
            "forecast": p.forecasts.as_dict()}


def throughput(bundle: Bundle, args, prompts: list[str], seeds: list[int]) -> dict:
    batches = [int(b) for b in args.batches.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if spec_for(m.strip())] or list(METHODS)
    if "ar" not in methods:
        methods.insert(0, "ar")
    if getattr(args, "control", False):
        methods.append("ar'")  # ar again, timed like the others: its ratio to ar is the instrument's noise
    path = Path(args.json_path) if args.json_path else None
    out = json.loads(path.read_text()) if path and path.exists() else {}
    cfg_rows = 2 if bundle.sampling.use_cfg else 1
    if "floor" not in out:
        f = matmul_flops(args.device, bundle.target.config.dim)
        fpi = flops_per_image(bundle, cfg_rows)
        out.update({"bundle": bundle.name, "target": describe(bundle.name), "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
                    "floor": {"matmul_flops": f, "flops_per_image": fpi, "images_per_s": f / fpi}, "cells": {}})
    for temp_s in args.temperatures.split(","):
        temp = None if temp_s.strip() == "default" else float(temp_s)
        for b in batches:
            ps, ss = workload(prompts, seeds, cell_images(b, args.min_images))
            todo = [m for m in methods if f"{temp_s.strip()}|{b}|{m}" not in out["cells"]]
            runs: dict[str, list[dict]] = {m: [] for m in todo}
            for i, order in enumerate((todo, todo[::-1])[: args.passes]):  # each pass: all methods at once
                gens = {m: make_generator(bundle, spec_for(m), temp, b, ps, ss, args.device, args.dtype)
                        for m in order}
                for m, cell in run_together(gens, ps, ss, getattr(args, "clock", "wall"), order_seed=i).items():
                    runs[m].append(cell)
                del gens  # the pass's caches go before the next pass's are built (the stand-in at B 64:
                gc.collect()  # 2.3-2.9 GiB per method; two passes' at once did not fit 24 GB)
            for m, cells in runs.items():
                key = f"{temp_s.strip()}|{b}|{m}"
                best = max(cells, key=lambda c: c["images_per_s"])  # other load only ever slows a run
                best["passes"] = [c["images_per_s"] for c in cells]
                out["cells"][key] = best
                print(f"  {key}: {best['images_per_s']:.3f} images/s (passes {best['passes']})", flush=True)
            if path:
                path.write_text(json.dumps(out))
    report(out, methods, batches, [t.strip() for t in args.temperatures.split(",")])
    if path:
        path.write_text(json.dumps(out))
    if args.chart:
        chart(out, methods, batches, args.chart)
    return out


def report(out: dict, methods, batches, temps) -> None:
    cells, floor = out["cells"], out["floor"]["images_per_s"]
    print(f"\nthroughput  bundle {describe(out['bundle'])}, {out['device']}/{out['dtype']}, {out['threads']} threads; "
          f"compute floor {floor:.2f} images/s ({out['floor']['matmul_flops'] / 1e9:.1f} GFLOP/s matmul)")
    for t in temps:
        best_ar = max(cells[f"{t}|{b}|ar"]["images_per_s"] for b in batches)
        print(f"\ntemperature={t}")
        print(f"{'method':<15}{'batch':>6}{'images/s':>10}{'vs ar@batch':>12}{'vs best ar':>11}{'accept len':>11}"
              f"{'nodes/rnd':>10}{'drafted':>8}{'ms/level':>9}{'ceiling':>14}{'model tok/ms':>13}{'plain x ar':>11}"
              f"{'busy':>6}  equals ar")
        for b in batches:
            ar = cells[f"{t}|{b}|ar"]
            for m in methods:
                c = cells[f"{t}|{b}|{m}"]
                c["vs_ar_same_batch"] = c["images_per_s"] / ar["images_per_s"]
                c["vs_best_ar"] = c["images_per_s"] / best_ar
                exact = c["sampler"] in ("greedy", "coupled")
                c["equals_ar"] = (c["tokens"] == ar["tokens"]) if exact else None
                mine, ref = c.get("plain_ms_per_image_step", 0.0), ar.get("plain_ms_per_image_step", 0.0)
                c["plain_x_ar"] = mine / ref if mine and ref else None
                print(f"{m:<15}{b:>6}{c['images_per_s']:>10.3f}{c['vs_ar_same_batch']:>11.2f}x{c['vs_best_ar']:>10.2f}x"
                      f"{c['mean_acceptance_length']:>11.2f}{c['nodes_per_round']:>10.1f}{c['draft_rounds_share']:>8.2f}"
                      f"{c.get('draft_ms_per_level', 0.0):>9.2f}{_ceiling(c.get('ceiling')):>14}{_forecast(c.get('ceiling')):>13}"
                      f"{_plain(c['plain_x_ar']):>11}{_busy(c.get('occupancy')):>6}  {c['equals_ar'] if exact else '-'}")


def _plain(x: float | None) -> str:
    """'1.02x': a full batch's plain step's ms per image over `ar`'s in the same cell (wall clock,
    the rounds' own timer); '-' where a method ran no such step."""
    return "-" if x is None else f"{x:.2f}x"


def _busy(x: float | None) -> str:
    """'0.99': busy slots per round over the batch; '-' for `ar` (untraced; its waves step together)."""
    return "-" if x is None else f"{x:.2f}"


def _ceiling(ce: dict | None) -> str:
    """'1.71x (3x6)': the modelled best tree's rate over a plain step's, and its levels x nodes."""
    return "-" if not ce else f"{ce['x_plain']:.2f}x ({ce['levels']}x{ce['nodes']})"


def _forecast(ce: dict | None) -> str:
    """'1.07/0.98': over the drafted rounds a cost model sized, the tokens they committed over the
    tokens it expected, and their measured ms over its expected ms (out of sample: each expectation
    made before its round); '-' without such rounds."""
    f = (ce or {}).get("forecast") or {}
    if not f.get("rounds"):
        return "-"
    return f"{f['tokens_ratio']:.2f}/{f['ms_ratio']:.2f}"


def chart(out: dict, methods, batches, png: str) -> None:
    """images/s vs batch size per method (one panel per temperature), log-2 batch axis."""
    from PIL import Image, ImageDraw

    temps = sorted({k.split("|")[0] for k in out["cells"]})
    colours = {"ar": (40, 40, 40), "eagle2": (30, 120, 200), "adt": (220, 90, 30), "jacobi": (150, 40, 160)}
    w, h, pad = 420, 300, 50
    img = Image.new("RGB", (w * len(temps), h), "white")
    d = ImageDraw.Draw(img)
    top = max(c["images_per_s"] for c in out["cells"].values()) * 1.1
    for ti, t in enumerate(temps):
        x0 = ti * w
        d.rectangle([x0 + pad, 20, x0 + w - 20, h - pad], outline=(0, 0, 0))
        d.text((x0 + pad, 4), f"images/s vs batch, T={t}", fill=(0, 0, 0))
        xs = {b: x0 + pad + (w - pad - 20) * i / max(1, len(batches) - 1) for i, b in enumerate(batches)}
        for b, x in xs.items():
            d.text((x - 6, h - pad + 6), str(b), fill=(0, 0, 0))
        d.text((x0 + w // 2 - 70, h - pad + 24), "engine batch (images in flight)", fill=(0, 0, 0))
        for v in (0.25, 0.5, 0.75, 1.0):
            y = h - pad - (h - pad - 20) * v
            d.text((x0 + 4, y - 5), f"{top * v:.1f}", fill=(0, 0, 0))
        for mi, m in enumerate(methods):
            pts = [(xs[b], h - pad - (h - pad - 20) * out["cells"][f"{t}|{b}|{m}"]["images_per_s"] / top)
                   for b in batches if f"{t}|{b}|{m}" in out["cells"]]
            d.line(pts, fill=colours.get(m, (0, 150, 0)), width=2)
            for x, y in pts:
                d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colours.get(m, (0, 150, 0)))
            d.text((x0 + pad + 8, 26 + 12 * mi), m, fill=colours.get(m, (0, 150, 0)))
    img.save(png)
    print(f"wrote {png}")
