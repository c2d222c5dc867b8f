"""The run summary: counts, throughput, speedups and acceptance from one run's telemetry rows
(`summarize` -> summary.json), and the one screen a job prints at its end (`format_summary`).

Every number on the screen says what it is measured against:
- images/s over the whole run counts actor start-up (bundle loading, the cost table);
- decoding images/s is per second of engine time (the images' shares of their rounds,
  summed per actor): what the engine did once it ran;
- the steady rate (the pool once every actor was past its first wave of images in flight,
  which carries start-up and was decoded mostly before any image finished) is shown only over
  a window that means something: at least STEADY_MIN_S seconds and STEADY_MIN_IMAGES images,
  else the screen says why not (e.g. a job that was one wave of images in flight);
- speedups compare with batched vanilla AR at the same engine batch, measured (the sampled
  prompts decoded again with `ar` with as many images in flight: like-for-like rows only) or estimated (the rounds priced with this device's cost
  table), and the screen says which; when the cost budget ran mostly plain AR steps it says
  so and why, with where to read more.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from collections import Counter
from typing import Any, Optional

import pyarrow as pa
import pyarrow.compute as pc

from pipeline.telemetry import STATUS_FAILED, STATUS_OK

STEADY_MIN_S = 10.0  # a steady rate over less time than this is noise (one wave finishing together)
STEADY_MIN_IMAGES = 20
PLAIN_NODES_PER_ROUND = 1.0  # fewer draft nodes per round than this: the rounds were mostly plain AR steps
BUDGET_DOC = 'docs/adt_tree.md ("The cost budget")'


def _percentile(sorted_vals: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of an ascending list."""
    pos = (len(sorted_vals) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _stats(values: list[Optional[float]]) -> dict[str, Optional[float]]:
    vals = sorted(v for v in values if v is not None and not math.isnan(v))
    if not vals:
        return {"count": 0, "mean": None, "median": None, "p10": None, "p50": None, "p90": None}
    return {"count": len(vals), "mean": statistics.fmean(vals), "median": statistics.median(vals),
            "p10": _percentile(vals, 0.1), "p50": _percentile(vals, 0.5), "p90": _percentile(vals, 0.9)}


def steady_window(ok: pa.Table, in_flight: int = 1) -> tuple[int, float]:
    """(images, seconds) of the pool in steady state: from the moment every actor had finished
    its first `in_flight` images (its first wave, decoded mostly before that moment, with actor
    start-up and bundle loading) to the last image; the images finished in that window."""
    if ok.num_rows < 2 or "actor_id" not in ok.column_names:
        return 0, 0.0
    per_actor: dict[str, list[dt.datetime]] = {}
    times = ok["finished_at"].to_pylist()
    for actor, t in zip(ok["actor_id"].to_pylist(), times):
        per_actor.setdefault(actor, []).append(t)
    if any(len(ts) <= in_flight for ts in per_actor.values()):
        return 0, 0.0  # an actor never got past its first wave
    t0 = max(sorted(ts)[in_flight - 1] for ts in per_actor.values())
    later = [t for t in times if t > t0]
    return len(later), ((max(later) - t0).total_seconds() if later else 0.0)


def steady_rate(ok: pa.Table, in_flight: int = 1) -> tuple[Optional[float], Optional[str]]:
    """(steady images/s, None) over a window that means something, else (None, why not)."""
    images, seconds = steady_window(ok, in_flight)
    if seconds >= STEADY_MIN_S and images >= STEADY_MIN_IMAGES:
        return images / seconds, None
    if images == 0:
        return None, (f"not shown: no actor got past its first wave of images (up to {in_flight} in flight each), "
                      "so there was no steady state to measure")
    return None, (f"not shown: after the first wave only {images} images finished, over {seconds:.1f} s (a steady "
                  f"rate needs {STEADY_MIN_IMAGES}+ images over {STEADY_MIN_S:g}+ s)")


def _column(table: pa.Table, name: str) -> list[Any]:
    """A column's values; a column missing from older ledger parts reads as nulls."""
    return table[name].to_pylist() if name in table.column_names else [None] * table.num_rows


def _engine_rate(ok: pa.Table) -> tuple[Optional[float], float, int]:
    """(images per second while the engines ran, engine seconds per actor, actors): an image's
    engine time is its share of its rounds, so an actor's images sum to its engine's time."""
    ms = [v for v in _column(ok, "generation_time_ms") if v is not None]
    actors = len(set(_column(ok, "actor_id"))) or 1
    per_actor_s = sum(ms) / 1000.0 / actors
    return ((len(ms) / per_actor_s) if per_actor_s > 0 else None), per_actor_s, actors


def _nodes_per_round(ok: pa.Table) -> Optional[float]:
    """Draft nodes verified per round over the run's images (0 for plain AR steps)."""
    steps = sum(v or 0 for v in _column(ok, "num_spec_steps"))
    nodes = sum(v or 0 for v in _column(ok, "num_draft_tokens"))
    return nodes / steps if steps else None


def summarize(table: pa.Table, *, wall_time_s: float, skipped: int = 0, total_input: Optional[int] = None,
              in_flight: int = 1) -> dict[str, Any]:
    """Counts, throughput, speedups and acceptance of one run's telemetry rows (`in_flight`:
    images each actor's engine holds at once)."""
    statuses = Counter(table["status"].to_pylist()) if table.num_rows else Counter()
    ok_n, failed = statuses.get(STATUS_OK, 0), statuses.get(STATUS_FAILED, 0)
    ok = table.filter(pc.equal(table["status"], STATUS_OK)) if table.num_rows else table
    col = lambda name: _column(ok, name)  # noqa: E731
    errors = Counter((e or "")[:120] for e, s in zip(table["error"].to_pylist(), table["status"].to_pylist())
                     if s == STATUS_FAILED) if table.num_rows else Counter()
    steady, steady_note = steady_rate(ok, in_flight)
    decode_rate, engine_s, actors = _engine_rate(ok)
    return {
        "total_input": total_input, "processed": ok_n + failed, "ok": ok_n, "failed": failed, "skipped": skipped,
        "wall_time_s": wall_time_s,
        "images_per_second": (ok_n / wall_time_s) if wall_time_s > 0 else None,
        "decode_images_per_second": decode_rate, "engine_time_s": engine_s, "engine_actors": actors,  # per actor
        "steady_images_per_second": steady, "steady_note": steady_note,
        "speedup": _stats(col("speedup")),
        "estimated_speedup": _stats(col("estimated_speedup")),
        "estimated_speedup_model": _stats(col("estimated_speedup_model")),
        "estimate_calibrated_rows": sum(1 for x in col("estimate_source") if x and x.startswith("calibrated")),
        "draft_nodes_per_round": _nodes_per_round(ok),
        "mean_acceptance_length": _stats(col("mean_acceptance_length")),
        "draft_acceptance_rate": _stats(col("draft_acceptance_rate")),
        "generation_time_ms": _stats(col("generation_time_ms")),
        "baseline_tokens_match": sum(1 for m in col("baseline_tokens_match") if m is True),
        "baseline_tokens_mismatch": sum(1 for m in col("baseline_tokens_match") if m is False),
        # a mismatch where exactness is promised (greedy or coupled sampling, no LANTERN) is a bug
        "exactness_errors": sum(1 for m, smp, lossy in zip(col("baseline_tokens_match"), col("sampler"), col("lossy"))
                                if m is False and smp in ("greedy", "coupled") and not lossy),
        "top_errors": [{"error": e, "count": n} for e, n in errors.most_common(5)],
    }


# ----------------------------------------------------------------------------------------
# The screen


def _fmt(x: Optional[float], spec: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def _time_lines(s: dict[str, Any]) -> list[str]:
    g = s["generation_time_ms"]
    actors = s.get("engine_actors") or 1
    lines = [f"time      {_fmt(s['wall_time_s'], '.1f', ' s')}   {_fmt(s['images_per_second'], '.2f')} images/s "
             "over the whole run (actor start-up included)"]
    if s.get("decode_images_per_second") is not None:
        where = f" per actor, {actors} actors" if actors > 1 else ""
        lines.append(f"decoding  {s['decode_images_per_second']:.2f} images/s while the engine ran ({s['ok']} images "
                     f"in {s['engine_time_s']:.1f} s of engine time{where})   "
                     f"per image {_fmt(g['mean'], '.0f', ' ms')} (mean) p10 {_fmt(g['p10'], '.0f')} "
                     f"p50 {_fmt(g['p50'], '.0f')} p90 {_fmt(g['p90'], '.0f')}")
    steady = s.get("steady_images_per_second")
    if steady is not None:
        lines.append(f"steady    {steady:.2f} images/s once every actor was past its first wave of images")
    elif s.get("steady_note") and s["ok"]:
        lines.append(f"steady    {s['steady_note']}")
    return lines


def _speedup_lines(s: dict[str, Any]) -> list[str]:
    """What the speedup compares against, whether measured or estimated, and why it is low
    when the budget ran mostly plain steps."""
    if s.get("method") == "ar":
        return ["speedup   - (method ar is the baseline itself)"]
    batch = f" ({s['engine_batch']} in flight)" if s.get("engine_batch") else ""
    vs = f"vs batched AR at the same batch{batch}"
    m, e = s["speedup"], s["estimated_speedup"]
    lines = []
    if m["count"]:
        lines.append(_line("speedup", f"measured {_fmt(m['median'], '.2f', 'x')} median, {_fmt(m['mean'], '.2f', 'x')} "
                                      f"mean (n={m['count']}) vs batched AR at the same occupancy{batch}: the sampled "
                                      "prompts decoded again with ar, as many images in flight"))
    if e["count"]:
        how = ("scaled by the measured rows" if s.get("estimate_calibrated_rows") else
               "a model, not a measurement: --baseline-fraction above 0 measures it")
        lines.append(_line("" if m["count"] else "speedup",
                           f"estimated {_fmt(e['median'], '.2f', 'x')} median {vs}, from the rounds priced with this "
                           f"device's cost table ({how})"))
    nodes = s.get("draft_nodes_per_round")
    if s.get("method") == "adt" and nodes is not None and nodes < PLAIN_NODES_PER_ROUND:
        why = ("the cost budget measured drafted rounds slower per committed token than plain batched AR steps on "
               "this device, so it drafts only in its probe rounds" if s.get("budget") == "cost" else
               "the planned trees were small")
        lines.append(_line("note", f"mostly plain AR steps ({nodes:.2f} draft nodes per round): {why}; see {BUDGET_DOC}"))
    return lines


def _line(label: str, text: str) -> str:
    return f"{label:<9} {text}"


def format_summary(summary: dict[str, Any], *, title: str = "generation summary", where: Optional[dict[str, str]] = None,
                   report_hint: Optional[str] = None) -> str:
    """The one screen a job prints at its end (the lines docs/pipeline.md shows)."""
    s = summary
    lines = [f"== {title} ==",
             f"prompts   ok {s['ok']}   failed {s['failed']}   skipped (already done) {s['skipped']}"
             + (f"   of {s['total_input']}" if s.get("total_input") is not None else "")]
    lines += _time_lines(s)
    if s["ok"]:
        lines += _speedup_lines(s)
        lines.append(f"accept    mean length {_fmt(s['mean_acceptance_length']['mean'])} tokens per step   draft "
                     f"acceptance rate {_fmt(s['draft_acceptance_rate']['mean'], '.3f')}")
    if s.get("exactness_errors"):
        lines.append(f"ERROR     {s['exactness_errors']} baseline rows decoded different tokens than AR although the "
                     "sampler promises the same tokens (greedy / coupled, fp32): exactness is broken")
    other = (s.get("baseline_tokens_mismatch") or 0) - (s.get("exactness_errors") or 0)
    if other:
        lines.append(f"note      {other} baseline rows differ from AR as expected (rejection sampler, LANTERN or bf16)")
    for err in s.get("top_errors", []):
        lines.append(f"error     {err['count']} x {err['error']}")
    for name, uri in (where or {}).items():
        lines.append(f"{name:<9} {uri}")
    if report_hint:
        lines.append(_line("report", f"python -m jobs.report {report_hint}   (charts of throughput, speedup, "
                                     "acceptance and the tree maps)"))
    return "\n".join(lines)


def report_args(cfg: Any) -> str:
    """The arguments of `python -m jobs.report` for a job's output: its root, and the job's
    S3 endpoint when it has its own (job.json cannot be read without it)."""
    ep = cfg.storage.endpoint_url if str(cfg.output).startswith("s3://") else None
    return f"{cfg.output} --endpoint-url {ep}" if ep else str(cfg.output)
