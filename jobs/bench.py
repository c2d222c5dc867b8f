"""Engine benchmark: decoding methods side by side on the same prompts, in one process, no Ray.

    python -m jobs.bench                       # methods x temperatures table on the default bundle
    python -m jobs.bench --samplers coupled,rejection --temperatures default,1.0   # the two samplers
    python -m jobs.bench --calibrate           # target forward cost at 1, 8, 16, 32, 64 new tokens
    python -m jobs.bench --throughput --json docs/throughput.json --chart docs/img/throughput.png
                                               # images/s of ar / eagle2 / adt at batch 1, 4, 16, 64
    python -m jobs.bench --cost-curves --xl    # forward ms vs new tokens per image at 1, 16, 64 images
    python -m jobs.bench --bundle random --dim 512 --layers 6 --heads 8 --vocab 4096 --calibrate

Speed is reported as ratios of medians measured in this run (never compared across runs).
Flags: one per BenchConfig field (`_` or `-`, no abbreviations); a bad one exits 2.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import ClassVar, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field

from adt_core import AdaptiveConfig, DecodeConfig, Generator, LanternConfig, TreeConfig, load_bundle, random_bundle
from adt_core.bundles.bundle import Bundle
from adt_core.bundles.deepen import deepen, describe
from adt_core.calibrate import SIZES, measure_draft_level, measure_target_cost, typical_prefix
from pipeline.cli import CliParser, add_config_flags, config_overrides
from pipeline.config import ConfigError, build_model

DEFAULT_METHODS = "ar,static,eagle2,adt,adt+cost,adt+lantern,adt+cost+lantern"


def method_specs(lantern: LanternConfig) -> dict[str, dict]:
    """The methods compared, as DecodeConfig fields (EAGLE-2 as used for visual AR: 5 levels,
    top-k 10, 59 total tokens = root + 58 drafted)."""
    return {
        "ar": dict(method="ar"),
        "static": dict(method="static", tree=TreeConfig(depth=5)),
        "eagle2": dict(method="eagle2"),  # its default: the tree sized for this device
        "adt": dict(method="adt", adaptive=AdaptiveConfig()),
        "adt+cost": dict(method="adt", adaptive=AdaptiveConfig(budget="cost")),
        "adt+lantern": dict(method="adt", adaptive=AdaptiveConfig(), lantern=lantern),
        "adt+cost+lantern": dict(method="adt", adaptive=AdaptiveConfig(budget="cost"), lantern=lantern),
    }


def sweep_specs() -> dict[str, dict]:
    """Sensitivity study of the ADT-Tree controller around its defaults (one change at a time)."""
    base = AdaptiveConfig()
    rep = lambda **kw: dict(method="adt", adaptive=dataclasses.replace(base, **kw))  # noqa: E731
    out = {"adt (defaults)": rep()}
    for beta in (0.3, 0.7, 0.9):
        out[f"beta={beta}"] = rep(beta=beta)
    out["d in [2,6]"] = rep(d_max=6)
    out["d in [3,10]"] = rep(d_min=3, d_max=10)
    out["k in [1,16]"] = rep(k_min=1)
    out["k in [2,8]"] = rep(k_max=8)
    out["k in [4,24]"] = rep(k_min=4, k_max=24)
    out["n in [8,32]"] = rep(n_max=32)
    out["gamma=0.5"] = rep(gamma=0.5)
    out["init=vertical"] = rep(init="vertical")
    out["init=both"] = rep(init="both")
    out["mode=step"] = rep(mode="step")
    out["budget=cost"] = rep(budget="cost")
    return out


class BenchConfig(BaseModel):
    """jobs.bench's options (one flag per field: pipeline/cli.py)."""

    model_config = ConfigDict(extra="forbid")
    cli_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "modes (default: methods side by side)": ("sweep", "calibrate", "throughput", "cost_curves", "xl"),
        "--throughput": ("batches", "min_images", "passes", "control", "clock", "chart"),
        "LANTERN (adt+lantern methods)": ("lantern_k", "lantern_delta"),
        "random bundle (--bundle random)": ("dim", "layers", "heads", "vocab", "grid", "caption_len"),
    }

    bundle: str = Field("emoji16", description="Bundle name or directory, or 'random' for a random-init one.")
    target_layers: Optional[int] = Field(None, ge=1, description="Deepen the target to N layers with null layers "
                                         "(adt_core/bundles/deepen.py): the bundle's own images at the cost of an "
                                         "N-layer target (emoji16 at 32: a Chameleon-7B-deep stand-in).")
    prompts: str = Field("examples/prompts.parquet", description="Parquet with prompt_id, prompt[, seed].")
    limit: int = Field(8, ge=1, description="Number of prompts to run.")
    methods: str = Field(DEFAULT_METHODS, description="Comma list of ar, static, eagle2, adt, adt+cost, adt+lantern, "
                         "adt+cost+lantern.")
    baseline: bool = Field(True, description="Add 'ar' (--no-baseline: acceptance statistics only, no speedups).")
    heatmaps: Optional[str] = Field(None, description="Also draw depth / width / accepted maps of the adt runs of the "
                                    "first 4 prompts into this PNG.")
    temperatures: str = Field("0,default", description="Comma list: numbers or 'default' (bundle defaults).")
    samplers: str = Field("coupled", description="Comma list of coupled, rejection (sampled rows only).")
    draft_scores: str = Field("perturbed", description="Comma list of perturbed, logq: the coupled drafts' path score "
                              "(rerank, cost budget).")
    device: str = Field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu",
                        description="Torch device (cuda when this process sees one).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Compute dtype.")
    threads: int = Field(0, ge=0, description="Torch CPU threads (0 = torch's default).")
    json_path: Optional[str] = Field(None, alias="json", description="Write the results as JSON here.")
    repeats: int = Field(7, ge=1, description="Timed repeats per size in --calibrate.")
    sweep: bool = Field(False, description="ADT-Tree sensitivity study (temperature 0) instead.")
    calibrate: bool = Field(False, description="Only measure target forward cost vs new tokens.")
    throughput: bool = Field(False, description="Images/s per method and engine batch size (jobs/throughput.py); "
                             "--methods defaults to ar,eagle2,adt,jacobi.")
    cost_curves: bool = Field(False, description="Ms of a target forward at n = 1..64 new tokens per image for 1, 16, "
                              "64 images (jobs/cost_curves.py); with --xl also a random LlamaGen-XL-shaped target in bf16.")
    xl: bool = Field(False, description="--cost-curves: add the LlamaGen-XL-shaped target.")
    batches: str = Field("1,4,16,64", description="Engine batch sizes.")
    min_images: int = Field(8, ge=1, description="Images per cell at least (and the batch).")
    passes: int = Field(2, ge=1, le=2, description="Passes per cell (best kept): 1 or 2.")
    control: bool = Field(False, description="Also time ar as a method of its own (ar'): its ratio to ar is the noise.")
    clock: Literal["wall", "cpu"] = Field("wall", description="Images per wall second, or per CPU second of this "
                                          "process (a shared CPU).")
    chart: Optional[str] = Field(None, description="Images/s vs batch chart (PNG).")
    lantern_k: int = Field(100, ge=1, description="Codebook neighbours considered.")
    lantern_delta: float = Field(0.5, ge=0, le=1, description="Mass moved per token (lossy).")
    dim: int = Field(512, ge=1, description="Model width.")
    layers: int = Field(6, ge=1, description="Target layers.")
    heads: int = Field(8, ge=1, description="Attention heads.")
    vocab: int = Field(4096, ge=2, description="Codebook size.")
    grid: tuple[int, int] = Field((16, 16), description="Token grid H W.")
    caption_len: int = Field(32, ge=1, description="Caption tokens.")


def build_parser() -> CliParser:
    ap = CliParser("python -m jobs.bench", description=__doc__)
    add_config_flags(ap, BenchConfig)
    return ap


def parse_args(argv=None) -> BenchConfig:
    """The options (exit 2 with a usage line and one error line on a bad flag or value)."""
    ap = build_parser()
    args = vars(ap.parse_args(argv))
    try:
        return build_model(BenchConfig, config_overrides(args, BenchConfig), what="options")
    except ConfigError as e:
        ap.error(" ".join(line.strip() for line in str(e).splitlines()))


def get_bundle(args) -> Bundle:
    if args.bundle == "random":
        bundle = random_bundle(seed=0, vocab=args.vocab, grid=tuple(args.grid), dim=args.dim, n_layer=args.layers,
                               n_head=args.heads, caption_len=args.caption_len, caption_dim=64)
    else:
        bundle = load_bundle(args.bundle)
    layers = getattr(args, "target_layers", None)
    return bundle if layers is None else deepen(bundle, layers)


def read_prompts(path: str, limit: int) -> tuple[list[str], list[int]]:
    if not Path(path).exists():
        prompts = ["a smiling face", "a red heart", "a cat", "a slice of pizza", "a green tree", "a blue car",
                   "a yellow star", "a dog face"]
        return prompts[:limit], list(range(min(limit, len(prompts))))
    import pyarrow.parquet as pq

    t = pq.read_table(path).slice(0, limit).to_pylist()
    return [r["prompt"] for r in t], [int(r.get("seed") or i) for i, r in enumerate(t)]


def calibrate(bundle: Bundle, args) -> dict:
    target = bundle.target.to(args.device, getattr(torch, args.dtype))
    rows = 2 if bundle.sampling.use_cfg else 1
    table = measure_target_cost(target, rows=rows, sizes=SIZES, repeats=args.repeats,
                                prefix_len=typical_prefix(bundle.make_prompter()))
    params = sum(p.numel() for p in target.parameters())
    print(f"target forward cost  bundle={describe(bundle.name)} params={params / 1e6:.1f}M device={args.device} "
          f"dtype={args.dtype} rows={rows} threads={torch.get_num_threads()}")
    print(f"{'new tokens':>10} {'ms':>9} {'x 1 token':>10}")
    for n, ms in table.ms.items():
        print(f"{n:>10} {ms:>9.2f} {table.ratio(n):>10.2f}")
    level = None
    if bundle.drafter is not None:
        drafter = bundle.drafter.to(args.device, getattr(torch, args.dtype))
        level = measure_draft_level(drafter, target.head, bundle.sampling.cfg_scale, rows, repeats=args.repeats,
                                    vocab_size=target.vocab.vocab_size)
        print(f"one draft level (top-10 frontier): {level:.2f} ms = {level / table.cost(1):.2f} x a 1-token step")
    return {"bundle": bundle.name, "target": describe(bundle.name), "params": params, "device": args.device, "dtype": args.dtype, "rows": rows,
            "ms": table.ms, "ratio": {n: table.ratio(n) for n in table.ms}, "draft_level_ms": level}


def run_method(bundle, spec, temperature, prompts, seeds, args) -> dict:
    kw = dict(spec)
    if temperature is not None:
        kw["temperature"] = temperature
    gen = Generator(bundle, DecodeConfig(device=args.device, dtype=args.dtype, batch_size=1, **kw))
    gen.generate(prompts[:1], seeds[:1])  # warm-up (and one-off costs: calibration, neighbour table)
    sampler = gen.sampler.kind
    results, secs = [], []
    for p, s in zip(prompts, seeds):  # one image at a time: every method at batch size 1
        t0 = time.perf_counter()
        results.append(gen.generate([p], [s])[0])
        secs.append(time.perf_counter() - t0)
    st = [r.stats for r in results]
    rounds = [x for s in st for x in s.rounds]
    return {
        "results": results,
        "sampler": sampler,
        "draft_score": gen.config.draft_score,
        "mean_acceptance_length": statistics.mean(x.mean_acceptance_length for x in st),
        "target_forwards": statistics.mean(x.target_forwards for x in st),
        "draft_tokens": statistics.mean(x.draft_tokens for x in st),
        "nodes_per_round": statistics.mean(r.nodes for r in rounds) if rounds else 0.0,
        "accepted_per_node": (sum(x.accepted_draft_tokens for x in st) / max(1, sum(x.draft_tokens for x in st))),
        "draft_ms_per_round": statistics.mean(r.draft_ms for r in rounds) if rounds else 0.0,
        "verify_ms_per_round": statistics.mean(r.verify_ms for r in rounds) if rounds else 0.0,
        "lossy": any(x.lossy for x in st),
        "seconds_median": statistics.median(secs),
        "seconds_mean": statistics.mean(secs),
    }


def variants(specs: dict[str, dict], samplers: list[str], scores: list[str]) -> dict[str, dict]:
    """Every spec under every sampler and (coupled drafts only) draft score; names get a
    [sampler/score] tag when more than one is compared."""
    out = {}
    for name, spec in specs.items():
        for smp in samplers:
            scored = smp == "coupled" and spec["method"] != "ar" and len(scores) > 1
            for sc in (scores if scored else scores[:1]):
                tag = "/".join(([smp] if len(samplers) > 1 else []) + ([sc] if scored else []))
                out[name + (f" [{tag}]" if tag else "")] = {**spec, "sampler": smp, "draft_score": sc}
    return out


def compare(bundle, specs: dict[str, dict], temperature, prompts, seeds, args, label: str) -> dict:
    """Run every spec on the same prompts and seeds; print and return one table (ratios vs the
    'ar' row of the same sampler). `equals ar` is reported wherever exactness is promised:
    greedy, and the coupled sampler at any temperature."""
    rows = {m: run_method(bundle, spec, temperature, prompts, seeds, args) for m, spec in specs.items()}
    ars = {r["sampler"]: r for m, r in rows.items() if specs[m]["method"] == "ar"}  # absent with --no-baseline
    print(f"\n{label}  ({len(prompts)} prompts, bundle {describe(bundle.name)}, {args.device}/{args.dtype}, "
          f"{torch.get_num_threads()} threads)")
    print(f"{'method':<34}{'accept len':>11}{'acc/node':>9}{'target fwd':>11}{'nodes/rnd':>10}{'draft ms':>9}"
          f"{'verify ms':>10}{'s/image':>9}{'speedup':>9}  equals ar")
    table = {}
    for m, r in rows.items():
        ar = ars.get(r["sampler"])
        exact_promised = r["sampler"] in ("greedy", "coupled") and ar is not None
        out = {k: v for k, v in r.items() if k != "results"}
        out["speedup"] = ar["seconds_median"] / r["seconds_median"] if ar else float("nan")
        if exact_promised:
            out["equals_ar"] = all(torch.equal(a.tokens, b.tokens) for a, b in zip(r["results"], ar["results"]))
        table[m] = out
        tag = " (lossy)" if out["lossy"] else ""
        print(f"{m + tag:<34}{out['mean_acceptance_length']:>11.2f}{out['accepted_per_node']:>9.3f}"
              f"{out['target_forwards']:>11.1f}{out['nodes_per_round']:>10.1f}{out['draft_ms_per_round']:>9.1f}"
              f"{out['verify_ms_per_round']:>10.1f}{r['seconds_median']:>9.3f}{out['speedup']:>8.2f}x"
              f"  {out.get('equals_ar', '-')}")
    table["_results"] = rows  # kept for heatmaps; dropped before JSON
    return table


def bench(bundle: Bundle, args) -> dict:
    prompts, seeds = read_prompts(args.prompts, args.limit)
    specs_all = method_specs(LanternConfig(k=args.lantern_k, delta=args.lantern_delta))
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in specs_all]
    if unknown:
        sys.exit(f"unknown methods {unknown}; known: {sorted(specs_all)}")
    if "ar" not in methods and args.baseline:
        methods.insert(0, "ar")
    samplers = [x.strip() for x in args.samplers.split(",") if x.strip()]
    scores = [x.strip() for x in args.draft_scores.split(",") if x.strip()]
    out = {"bundle": bundle.name, "target": describe(bundle.name), "device": args.device, "dtype": args.dtype, "prompts": len(prompts),
           "threads": torch.get_num_threads(), "tables": {}}
    if args.sweep:
        specs = variants({"ar": specs_all["ar"], "eagle2": specs_all["eagle2"], **sweep_specs()}, samplers[:1], scores[:1])
        out["tables"]["sweep@0"] = compare(bundle, specs, 0.0, prompts, seeds, args, "ADT-Tree sensitivity, temperature=0")
    else:
        for temp_s in args.temperatures.split(","):
            temperature = None if temp_s.strip() == "default" else float(temp_s)
            label = f"temperature={temp_s.strip()}" + (f" ({bundle.sampling.temperature})" if temperature is None else "")
            specs = variants({m: specs_all[m] for m in methods}, samplers, scores)
            out["tables"][temp_s.strip()] = compare(bundle, specs, temperature, prompts, seeds, args, label)
    if args.heatmaps:
        draw_heatmaps(bundle, out, args.heatmaps)
    for t in out["tables"].values():
        t.pop("_results", None)
    return out


def draw_heatmaps(bundle: Bundle, out: dict, path: str) -> None:
    from jobs.plots import heatmap_panel, stack_panels, trace_maps

    panels = []
    for tname, table in out["tables"].items():
        key = next((k for k in table["_results"] if k in ("adt", "adt (defaults)") or k.startswith("adt [")), None)
        if key is None:
            continue
        cfg = AdaptiveConfig()
        bounds = {"depth": (cfg.d_min, cfg.d_max), "width": (cfg.k_min, cfg.k_max), "accepted": (1, cfg.d_max + 1)}
        for r in table["_results"][key]["results"][:4]:
            maps = trace_maps(r.stats.rounds, bundle.grid)
            panels.append(heatmap_panel(r.image, maps, bounds, f"T={tname} {r.prompt}"))
    if panels:
        stack_panels(panels).save(path)
        print(f"wrote {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = get_bundle(args)
    if args.cost_curves:
        from jobs.cost_curves import run

        run(bundle, args.device, args.dtype, args.xl, args.json_path)
        return 0
    if args.throughput:
        from jobs.throughput import throughput

        if args.methods == DEFAULT_METHODS:
            args.methods = "ar,eagle2,adt,jacobi"
        prompts, seeds = read_prompts(args.prompts, 10**9)
        result = throughput(bundle, args, prompts, seeds)
        print(f"\nwrote {args.json_path}" if args.json_path else "")
        return 0
    result = calibrate(bundle, args) if args.calibrate else bench(bundle, args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
