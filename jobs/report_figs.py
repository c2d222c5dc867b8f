"""The report's charts: each function takes the job's data and returns PNG bytes.

Every chart exists for every job: where a job has no data for it (no baseline rows, no
speculative rounds, no failures) the panel says so instead of being blank.
"""

from __future__ import annotations

import io
import textwrap
from collections import Counter
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from jobs.plots import trace_maps
from jobs.report_charts import PALETTE, empty_note, figure, png, require_matplotlib, style_axes
from jobs.report_data import MAP_KEYS, TreeMaps, ok_rows
from jobs.study_table import seconds

MAP_TITLES = {"depth": "draft depth d", "width": "draft width k", "accepted": "accepted length (+ bonus)"}
MAP_CMAP = "viridis"


def _col(t: pa.Table, name: str) -> np.ndarray:
    if name not in t.column_names or t.num_rows == 0:
        return np.array([], dtype=float)
    a = t[name].to_numpy(zero_copy_only=False)
    a = np.array([np.nan if v is None else v for v in a], dtype=float) if a.dtype == object else a.astype(float)
    return a[~np.isnan(a)]


def _hist(ax, values: np.ndarray, label: str, color: str, bins) -> None:
    ax.hist(values, bins=bins, alpha=0.55, color=color, label=f"{label} (n={len(values)})")
    for q, ls in ((50, "-"), (90, "--")):
        v = np.percentile(values, q)
        ax.axvline(v, color=color, ls=ls, lw=1.4)
        ax.annotate(f"p{q} {v:.3g}", (v, 1), xycoords=("data", "axes fraction"), xytext=(3, -12 - (q == 90) * 12),
                    textcoords="offset points", fontsize=8, color=color)


def status_chart(rows: pa.Table) -> bytes:
    """Counts by status and failures by reason."""
    fig, (a, b) = figure(1, 2, width=11, height=2.6)
    statuses = Counter(rows["status"].to_pylist())
    names = sorted(statuses, key=lambda s: (s != "ok", s))
    a.barh(names, [statuses[s] for s in names], height=0.5,
           color=[PALETTE[2] if s == "ok" else PALETTE[3] for s in names])
    a.set_ylim(-0.75, max(len(names), 2) - 0.25)
    for i, s in enumerate(names):
        a.text(statuses[s], i, f" {statuses[s]:,}", va="center", fontsize=9)
    style_axes(a, "Prompts by status (latest row per prompt)", "prompts", "")
    reasons = failure_reasons(rows)
    if reasons:
        labels = [textwrap.shorten(r, 60) for r, _ in reasons][::-1]
        b.barh(labels, [n for _, n in reasons][::-1], height=0.5, color=PALETTE[3])
        style_axes(b, "Failures by reason", "prompts", "")
        b.tick_params(axis="y", labelsize=8)
    else:
        empty_note(b, "No failed prompts")
    return png(fig)


def failure_reasons(rows: pa.Table, top: int = 8) -> list[tuple[str, int]]:
    failed = rows.filter(pc.fill_null(pc.not_equal(rows["status"], "ok"), True))
    errs = Counter(((e or "unknown error").split("\n")[0][:100]) for e in failed["error"].to_pylist())
    return errs.most_common(top)


def throughput_chart(rows: pa.Table) -> bytes:
    """Cumulative ok images per actor over time, and the whole job's rate per time bin."""
    fig, (a, b) = figure(1, 2, width=11, height=3.6)
    ok = ok_rows(rows)
    if ok.num_rows < 2:
        empty_note(a, "Fewer than two ok images")
        empty_note(b, "Fewer than two ok images")
        return png(fig)
    t = seconds(ok["finished_at"])
    t0 = t.min()
    actors = np.array(ok["actor_id"].to_pylist(), dtype=object)
    counts = Counter(actors)
    shown = [x for x, _ in counts.most_common(10)]
    for i, actor in enumerate(shown):
        ts = np.sort(t[actors == actor]) - t0
        a.step(ts, np.arange(1, len(ts) + 1), where="post", label=f"{str(actor)[:8]} ({len(ts):,})", color=PALETTE[i % 8])
    style_axes(a, "Images finished per actor", "seconds since the first image", "images (cumulative)")
    a.legend(title="actor" + (f" (top 10 of {len(counts)})" if len(counts) > 10 else ""), fontsize=8)
    span = max(t.max() - t0, 1e-3)
    nb = int(min(60, max(5, len(t) // 5)))
    h, edges = np.histogram(t - t0, bins=nb, range=(0, span))
    b.bar(edges[:-1], h / (edges[1] - edges[0]), width=edges[1] - edges[0], align="edge", color=PALETTE[0], alpha=0.8)
    style_axes(b, "Job throughput over time", "seconds since the first image", "images / s")
    return png(fig)


def time_chart(rows: pa.Table) -> bytes:
    """Per-image engine time of the job's method, and of the AR baseline where measured."""
    fig, (ax,) = figure(1, 1, width=11, height=3.4)
    ok = ok_rows(rows)
    gen, base = _col(ok, "generation_time_ms") / 1000, _col(ok, "baseline_time_ms") / 1000
    if not len(gen):
        empty_note(ax, "No ok images")
        return png(fig)
    allv = np.concatenate([gen, base])
    bins = np.linspace(allv.min(), allv.max() + 1e-9, 40)
    methods = sorted({m for m in ok["method"].to_pylist() if m})
    _hist(ax, gen, "/".join(methods) or "method", PALETTE[0], bins)
    if len(base):
        _hist(ax, base, "ar baseline (same prompts)", PALETTE[1], bins)
    style_axes(ax, "Engine time per image", "seconds", "images")
    ax.legend()
    return png(fig)


def speedup_chart(rows: pa.Table) -> bytes:
    """Measured vs estimated speedup: histograms with percentiles, and one against the other."""
    fig, (a, b) = figure(1, 2, width=11, height=3.8)
    ok = ok_rows(rows)
    meas, est = _col(ok, "speedup"), _col(ok, "estimated_speedup")
    if len(meas) or len(est):
        allv = np.concatenate([meas, est])
        bins = np.linspace(allv.min(), allv.max() + 1e-9, 30)
        if len(est):
            _hist(a, est, "estimated (every row)", PALETTE[4], bins)
        if len(meas):
            _hist(a, meas, "measured vs ar (baseline rows)", PALETTE[2], bins)
        a.axvline(1.0, color="#444", lw=0.8, ls=":")
        style_axes(a, "Speedup per image", "speedup (x)", "images")
        a.legend(fontsize=8)
    else:
        empty_note(a, "No speedup in the telemetry")
    # the model-only estimate: the calibrated one is scaled on these very rows (agreement by construction)
    model = "estimated_speedup_model" if "estimated_speedup_model" in ok.column_names else "estimated_speedup"
    both = ok.filter(pc.and_(pc.is_valid(ok["speedup"]), pc.is_valid(ok[model])))
    if both.num_rows:
        m, e = _col(both, "speedup"), _col(both, model)
        b.scatter(m, e, s=18, alpha=0.7, color=PALETTE[0])
        lo, hi = min(m.min(), e.min()) * 0.95, max(m.max(), e.max()) * 1.05
        b.plot([lo, hi], [lo, hi], color="#888", ls="--", lw=1, label="estimate = measurement")
        err = (np.mean(e) / np.mean(m) - 1) * 100
        style_axes(b, f"Model estimate vs measured (mean error {err:+.0f}%)", "measured speedup (x)",
                   "model-only estimated speedup (x)")
        b.legend(fontsize=8)
    else:
        empty_note(b, "No baseline rows: nothing measured to compare the estimate with\n(run with --baseline-fraction > 0)")
    return png(fig)


def acceptance_chart(rows: pa.Table) -> bytes:
    """Mean acceptance length per image, and accepted length per round over every round."""
    fig, (a, b) = figure(1, 2, width=11, height=3.4)
    ok = ok_rows(rows)
    mal = _col(ok, "mean_acceptance_length")
    if len(mal):
        _hist(a, mal, "images", PALETTE[0], 30)
        style_axes(a, "Mean acceptance length per image", "tokens per target forward", "images")
        a.legend(fontsize=8)
    else:
        empty_note(a, "No acceptance data")
    lens = ok["accepted_lengths"].combine_chunks().flatten() if "accepted_lengths" in ok.column_names and ok.num_rows else []
    if len(lens):
        per_round = np.bincount(np.asarray(lens.to_numpy(zero_copy_only=False), dtype=np.int64) + 1)
        x = np.arange(len(per_round))
        b.bar(x[1:], per_round[1:] / per_round.sum(), color=PALETTE[2])
        style_axes(b, f"Accepted length per round ({int(per_round.sum()):,} rounds)", "tokens committed (accepted + bonus)",
                   "share of rounds")
        b.set_xticks(x[1:])
    else:
        empty_note(b, "No speculative rounds (method ar)")
    return png(fig)


def _map_axes(ax, data: np.ndarray, title: str, vmin: float, vmax: float, fig, bar: bool = True):
    im = ax.imshow(data, cmap=MAP_CMAP, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_title(title, fontsize=9, loc="left")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)
    if bar:
        fig.colorbar(im, ax=ax, shrink=0.85)
    return im


def aggregate_map_chart(maps: Optional[TreeMaps]) -> bytes:
    """Mean depth, width and accepted length per grid cell over the job's images."""
    fig, axes = figure(1, 3, width=11, height=3.4)
    if maps is None:
        for ax in axes:
            empty_note(ax, "No speculative rounds in the telemetry")
        return png(fig)
    for ax, k in zip(axes, MAP_KEYS):
        m = maps.mean(k)
        _map_axes(ax, m, f"mean {MAP_TITLES[k]}", np.nanmin(m) if np.isfinite(m).any() else 0,
                  np.nanmax(m) if np.isfinite(m).any() else 1, fig)
    fig.suptitle(f"ADT-Tree maps per grid cell, averaged over {maps.images:,} images "
                 f"({maps.grid[0]}x{maps.grid[1]} tokens, raster order)", fontsize=10)
    return png(fig)


def single_map_chart(maps: Optional[TreeMaps], images: dict[str, bytes], prompts: dict[str, str]) -> bytes:
    """A few single images beside their own maps (shared colour scale per column)."""
    ids = [i for i in (maps.singles if maps else {})]
    if not ids:
        fig, (ax,) = figure(1, 1, width=11, height=1.6)
        empty_note(ax, "No speculative rounds in the telemetry")
        return png(fig)
    plt = require_matplotlib()
    from PIL import Image

    per = {i: trace_maps(maps.singles[i], maps.grid) for i in ids}
    bounds = {k: (np.nanmin([np.nanmin(per[i][k]) for i in ids]), np.nanmax([np.nanmax(per[i][k]) for i in ids]))
              for k in MAP_KEYS}
    fig, axes = plt.subplots(len(ids), 4, figsize=(11, 2.7 * len(ids)), squeeze=False, layout="constrained")
    for r, pid in enumerate(ids):
        ax = axes[r][0]
        if pid in images:
            ax.imshow(np.asarray(Image.open(io.BytesIO(images[pid])).convert("RGB")))
        ax.set_title(textwrap.shorten(prompts.get(pid, pid), 34), fontsize=9, loc="left")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.grid(False)
        for c, k in enumerate(MAP_KEYS, 1):
            im = _map_axes(axes[r][c], per[pid][k], MAP_TITLES[k], *bounds[k], fig, bar=False)
            if r == len(ids) - 1:
                fig.colorbar(im, ax=[axes[j][c] for j in range(len(ids))], location="bottom", shrink=0.8, aspect=30)
    return png(fig)


def sample_grid(samples: list[dict], images: dict[str, bytes], cols: int = 6) -> bytes:
    """Sample images with their prompts."""
    plt = require_matplotlib()
    from PIL import Image

    shown = [s for s in samples if s["prompt_id"] in images]
    if not shown:
        fig, (ax,) = figure(1, 1, width=11, height=1.6)
        empty_note(ax, "No images could be read")
        return png(fig)
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(11, 2.25 * rows), squeeze=False, layout="constrained")
    for ax in axes.ravel():
        ax.set_axis_off()
    for ax, s in zip(axes.ravel(), shown):
        ax.imshow(np.asarray(Image.open(io.BytesIO(images[s["prompt_id"]])).convert("RGB")))
        ax.set_title("\n".join(textwrap.wrap(s["prompt"] or "", 22)[:2]), fontsize=8)
    return png(fig)
