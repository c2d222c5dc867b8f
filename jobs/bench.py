"""Engine benchmark: decoding methods side by side on the same prompts, in one process, no Ray.

    python -m jobs.bench                       # methods x temperatures table on the default bundle
    python -m jobs.bench --calibrate           # target forward cost at 1, 8, 16, 32, 64 new tokens
    python -m jobs.bench --bundle random --dim 512 --layers 6 --heads 8 --vocab 4096 --calibrate

Speed is reported as ratios of medians measured in this run (never compared across runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from adt_core import DecodeConfig, Generator, TreeConfig, load_bundle, random_bundle
from adt_core.calibrate import SIZES, measure_target_cost
from adt_core.models.bundle import Bundle

METHOD_SPECS = {
    "ar": dict(method="ar"),
    "static": dict(method="static", tree=TreeConfig(depth=5)),
    "eagle2": dict(method="eagle2", tree=TreeConfig(depth=5, top_k=10, budget=58)),
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", default="emoji16", help="bundle name or directory, or 'random' for a random-init one")
    ap.add_argument("--prompts", default="examples/prompts.parquet", help="Parquet with prompt_id, prompt[, seed]")
    ap.add_argument("--limit", type=int, default=8, help="number of prompts to run")
    ap.add_argument("--methods", default="ar,static,eagle2", help=f"comma list of {sorted(METHOD_SPECS)}")
    ap.add_argument("--temperatures", default="0,default", help="comma list: numbers or 'default' (bundle defaults)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--calibrate", action="store_true", help="only measure target forward cost vs new tokens")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per size in --calibrate")
    g = ap.add_argument_group("random bundle (--bundle random)")
    g.add_argument("--dim", type=int, default=512)
    g.add_argument("--layers", type=int, default=6)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--vocab", type=int, default=4096)
    g.add_argument("--grid", type=int, nargs=2, default=(16, 16), metavar=("H", "W"))
    g.add_argument("--caption-len", type=int, default=32)
    return ap.parse_args(argv)


def get_bundle(args) -> Bundle:
    if args.bundle == "random":
        return random_bundle(seed=0, vocab=args.vocab, grid=tuple(args.grid), dim=args.dim, n_layer=args.layers,
                             n_head=args.heads, caption_len=args.caption_len, caption_dim=64)
    return load_bundle(args.bundle)


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
    table = measure_target_cost(target, rows=rows, sizes=SIZES, repeats=args.repeats)
    params = sum(p.numel() for p in target.parameters())
    print(f"target forward cost  bundle={bundle.name} params={params / 1e6:.1f}M device={args.device} "
          f"dtype={args.dtype} rows={rows} threads={torch.get_num_threads()}")
    print(f"{'new tokens':>10} {'ms':>9} {'x 1 token':>10}")
    for n, ms in table.ms.items():
        print(f"{n:>10} {ms:>9.2f} {table.ratio(n):>10.2f}")
    return {"bundle": bundle.name, "params": params, "device": args.device, "dtype": args.dtype, "rows": rows,
            "ms": table.ms, "ratio": {n: table.ratio(n) for n in table.ms}}


def run_method(bundle, spec, temperature, prompts, seeds, args) -> dict:
    kw = dict(spec)
    if temperature is not None:
        kw["temperature"] = temperature
    gen = Generator(bundle, DecodeConfig(device=args.device, dtype=args.dtype, **kw))
    gen.generate(prompts[:1], seeds[:1])  # warm-up
    results, secs = [], []
    for p, s in zip(prompts, seeds):  # one image at a time: every method at batch size 1
        t0 = time.perf_counter()
        results.append(gen.generate([p], [s])[0])
        secs.append(time.perf_counter() - t0)
    st = [r.stats for r in results]
    return {
        "tokens": [r.tokens for r in results],
        "mean_acceptance_length": statistics.mean(x.mean_acceptance_length for x in st),
        "target_forwards": statistics.mean(x.target_forwards for x in st),
        "draft_tokens": statistics.mean(x.draft_tokens for x in st),
        "seconds_median": statistics.median(secs),
        "seconds_mean": statistics.mean(secs),
    }


def bench(bundle: Bundle, args) -> dict:
    prompts, seeds = read_prompts(args.prompts, args.limit)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_SPECS]
    if unknown:
        sys.exit(f"unknown methods {unknown}; known: {sorted(METHOD_SPECS)}")
    if "ar" not in methods:
        methods.insert(0, "ar")
    out = {"bundle": bundle.name, "device": args.device, "dtype": args.dtype, "prompts": len(prompts), "tables": {}}
    for temp_s in args.temperatures.split(","):
        temperature = None if temp_s.strip() == "default" else float(temp_s)
        label = f"temperature={temp_s.strip()}" + (f" ({bundle.sampling.temperature})" if temperature is None else "")
        rows = {m: run_method(bundle, METHOD_SPECS[m], temperature, prompts, seeds, args) for m in methods}
        base = rows["ar"]["seconds_median"]
        greedy = (temperature if temperature is not None else bundle.sampling.temperature) == 0
        print(f"\n{label}  ({len(prompts)} prompts, bundle {bundle.name}, {args.device}/{args.dtype})")
        print(f"{'method':<14}{'accept len':>11}{'target fwd':>11}{'draft tok':>10}{'s/image':>9}{'speedup':>9}"
              + ("  equals ar" if greedy else ""))
        table = {}
        for m, r in rows.items():
            same = all(torch.equal(a, b) for a, b in zip(r["tokens"], rows["ar"]["tokens"]))
            r = {k: v for k, v in r.items() if k != "tokens"}
            r["speedup"] = base / r["seconds_median"]
            if greedy:
                r["equals_ar"] = same
            table[m] = r
            print(f"{m:<14}{r['mean_acceptance_length']:>11.2f}{r['target_forwards']:>11.1f}{r['draft_tokens']:>10.1f}"
                  f"{r['seconds_median']:>9.3f}{r['speedup']:>8.2f}x" + (f"  {same}" if greedy else ""))
        out["tables"][temp_s.strip()] = table
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = get_bundle(args)
    result = calibrate(bundle, args) if args.calibrate else bench(bundle, args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
