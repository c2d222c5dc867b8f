"""The numbers of a throughput study: one finished cell's telemetry -> `CellResult`, the
grid's results -> derived columns (speedup vs `ar`, scaling efficiency), Markdown and charts.

Steady state: per actor, its ok rows sorted by `finished_at`; the first `warmup` of them are
warm-up (bundle load, cost calibration, the engine's first fill). The actor's window starts
when its last warm-up row finished and ends at its last row; its rate is the rows finished in
that window over the window's length. A cell's images/s is the sum of its actors' rates.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from adt_core.bundles.deepen import describe

# telemetry columns a cell's numbers need (nothing else is read)
CELL_COLUMNS = ["prompt_id", "status", "actor_id", "finished_at", "generation_time_ms", "mean_acceptance_length",
                "draft_acceptance_rate"]


@dataclass(frozen=True)
class CellSpec:
    """One point of the grid."""

    bundle: str
    dtype: str
    method: str
    batch: int  # decode.batch_size: images in flight per actor
    actors: int

    @property
    def name(self) -> str:
        bundle = "".join(c if c.isalnum() or c in "-_" else "-" for c in self.bundle)
        return f"{bundle}_{self.dtype}_{self.method}_b{self.batch}_a{self.actors}"


@dataclass(frozen=True)
class CellResult:
    """What one cell measured (a row of the study table)."""

    cell: str
    bundle: str
    dtype: str
    method: str
    batch: int
    actors: int
    device: str  # cpu | cuda (the actors' device kind)
    devices: float  # GPUs held by the actors, or CPUs reserved for them (Ray's accounting)
    images: int  # ok rows in the steady windows (after warm-up)
    warmup: int  # warm-up rows per actor
    failed: int
    images_per_s: float  # steady state, all actors
    images_per_s_per_actor: float
    images_per_s_per_device: float
    engine_images_per_s: float  # all actors: steady images over the engine time attributed to them
    engine_ms_p50: float  # generation_time_ms: engine time attributed to each image
    engine_ms_p90: float
    latency_s_mean: float  # Little's law: images in flight / per-actor rate (no start time in telemetry)
    acceptance_length: float  # mean of mean_acceptance_length
    draft_acceptance_rate: Optional[float]
    wall_s: float  # the cell's whole run (Ray Data start-up and warm-up included)


def seconds(col) -> np.ndarray:
    """A timestamp column (any unit) as float seconds since the epoch."""
    typ = col.type
    return col.cast(pa.timestamp("ms", tz=typ.tz)).cast(pa.int64()).to_numpy() / 1000.0


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def measure_cell(spec: CellSpec, table: pa.Table, warmup: int, device: str, devices: float, wall_s: float) -> CellResult:
    """The steady-state numbers of one cell from its telemetry rows (CELL_COLUMNS)."""
    failed = int(pc.sum(pc.not_equal(table["status"], "ok")).as_py() or 0) if table.num_rows else 0
    ok = table.filter(pc.equal(table["status"], "ok")) if table.num_rows else table
    rates, engine, kept = [], [], []
    actors = ok["actor_id"].to_numpy(zero_copy_only=False) if ok.num_rows else np.array([])
    times = seconds(ok["finished_at"]) if ok.num_rows else np.array([])
    for actor in np.unique(actors):
        idx = np.flatnonzero(actors == actor)
        idx = idx[np.argsort(times[idx], kind="stable")]
        if len(idx) <= warmup:
            continue
        t0 = times[idx[warmup - 1]] if warmup > 0 else times[idx[0]]
        steady = idx[warmup:] if warmup > 0 else idx[1:]
        span = times[steady[-1]] - t0
        gen_ms = ok["generation_time_ms"].take(pa.array(steady, pa.int64()))
        busy = float(pc.sum(gen_ms).as_py() or 0.0) / 1000.0
        if span > 0:
            rates.append(len(steady) / span)
            engine.append(len(steady) / busy if busy > 0 else math.nan)
            kept.extend(steady.tolist())
    sel = ok.take(pa.array(sorted(kept), pa.int64())) if kept else ok.slice(0, 0)
    gen = sel["generation_time_ms"].to_numpy(zero_copy_only=False).astype(float) if sel.num_rows else np.array([])
    acc = sel["mean_acceptance_length"].to_numpy(zero_copy_only=False).astype(float) if sel.num_rows else np.array([])
    dar = pc.mean(sel["draft_acceptance_rate"]).as_py() if sel.num_rows else None
    total = float(sum(rates)) if rates else math.nan
    per_actor = total / len(rates) if rates else math.nan
    return CellResult(
        cell=spec.name, bundle=spec.bundle, dtype=spec.dtype, method=spec.method, batch=spec.batch, actors=spec.actors,
        device=device, devices=devices, images=len(kept), warmup=warmup, failed=failed,
        images_per_s=total, images_per_s_per_actor=per_actor,
        images_per_s_per_device=total / devices if devices > 0 else math.nan,
        engine_images_per_s=float(sum(engine)) if engine else math.nan,
        engine_ms_p50=_pct(gen, 50), engine_ms_p90=_pct(gen, 90),
        latency_s_mean=spec.batch / per_actor if per_actor and per_actor > 0 else math.nan,
        acceptance_length=float(np.nanmean(acc)) if acc.size else math.nan,
        draft_acceptance_rate=dar, wall_s=wall_s,
    )


def results_table(results: list[CellResult]) -> pa.Table:
    """The grid as Arrow, with `speedup_vs_ar` (images/s over `ar`'s at the same bundle,
    dtype, batch and actors) and `scaling_efficiency` (images/s over actors x the 1-actor
    cell's, or the smallest actor count measured)."""
    rows = [asdict(r) for r in results]
    rate = {(r["bundle"], r["dtype"], r["method"], r["batch"], r["actors"]): r["images_per_s"] for r in rows}
    for r in rows:
        ar = rate.get((r["bundle"], r["dtype"], "ar", r["batch"], r["actors"]))
        r["speedup_vs_ar"] = r["images_per_s"] / ar if ar and ar > 0 else None
        base_n = min(a for (b, d, m, bt, a) in rate if (b, d, m, bt) == (r["bundle"], r["dtype"], r["method"], r["batch"]))
        base = rate[(r["bundle"], r["dtype"], r["method"], r["batch"], base_n)]
        r["scaling_efficiency"] = (r["images_per_s"] / (base * r["actors"] / base_n)) if base and base > 0 else None
    names = [f.name for f in fields(CellResult)] + ["speedup_vs_ar", "scaling_efficiency"]
    if not rows:
        return pa.table({n: pa.array([], pa.float64()) for n in names})
    return pa.Table.from_pylist(rows).select(names)


def _f(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(table: pa.Table) -> str:
    head = ["method", "batch", "actors", "images/s", "per actor", "per device", "engine images/s", "engine ms p50", "p90",
            "latency s (mean)", "accept len", "vs ar", "scaling eff.", "images"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(table.to_pylist(), key=lambda r: (r["bundle"], r["dtype"], r["actors"], r["batch"], r["method"])):
        lines.append("| " + " | ".join([
            r["method"], str(r["batch"]), str(r["actors"]), _f(r["images_per_s"], ".3f"),
            _f(r["images_per_s_per_actor"], ".3f"), _f(r["images_per_s_per_device"], ".3f"),
            _f(r["engine_images_per_s"], ".3f"),
            _f(r["engine_ms_p50"], ".0f"), _f(r["engine_ms_p90"], ".0f"), _f(r["latency_s_mean"], ".1f"),
            _f(r["acceptance_length"], ".2f"), _f(r["speedup_vs_ar"], ".2f") + ("x" if r["speedup_vs_ar"] else ""),
            _f(r["scaling_efficiency"], ".2f"), str(r["images"]),
        ]) + " |")
    groups = sorted({(r["bundle"], r["dtype"], r["device"], r["devices"] / max(r["actors"], 1)) for r in table.to_pylist()})
    notes = [f"bundle {describe(b)}, {d}, {dev} ({per:g} {'GPU' if dev == 'cuda' else 'CPU'} per actor)" for b, d, dev, per in groups]
    return "\n".join(["Cells: " + "; ".join(notes), ""] + lines) + "\n"


def charts(table: pa.Table) -> dict[str, bytes]:
    """PNG bytes: `study_batch.png` (images/s vs batch per method, one panel per actor count)
    and `study_scaling.png` (images/s vs actors per method at each batch, with ideal lines)."""
    from jobs.report_charts import figure, png, style_axes

    rows = table.to_pylist()
    out: dict[str, bytes] = {}
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != "ar", m))
    actor_counts = sorted({r["actors"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = figure(1, len(actor_counts), width=5.2 * len(actor_counts), height=3.8)
    for ax, n in zip(axes, actor_counts):
        for m in methods:
            pts = sorted((r["batch"], r["images_per_s"]) for r in rows if r["method"] == m and r["actors"] == n)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        style_axes(ax, f"{n} actor{'s' if n > 1 else ''}", "engine batch size (images in flight)", "images / s (steady)")
        ax.legend(title="method")
    out["study_batch.png"] = png(fig)
    fig, axes = figure(1, len(batches), width=4.6 * len(batches), height=3.8)
    for ax, b in zip(axes, batches):
        for m in methods:
            pts = sorted((r["actors"], r["images_per_s"]) for r in rows if r["method"] == m and r["batch"] == b)
            if pts:
                line, = ax.plot(*zip(*pts), marker="o", label=m)
                n0, v0 = pts[0]
                ax.plot([p[0] for p in pts], [v0 * p[0] / n0 for p in pts], ls=":", color=line.get_color(), alpha=0.7)
        ax.set_xticks(actor_counts)
        style_axes(ax, f"batch {b}", "actors", "images / s (steady)")
        ax.legend(title="method (dotted: ideal)", fontsize=8)
    out["study_scaling.png"] = png(fig)
    return out


def to_parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()
