"""Offline report of one job's outputs: one self-contained HTML page and a Markdown summary.

    python -m jobs.report outputs/my-job                       # -> outputs/my-job/report/
    python -m jobs.report s3://bucket/runs/nightly --out reports/nightly

Reads job.json, summary.json and the telemetry (only the columns each chart needs; the
per-round traces streamed: jobs.report_data) of a local folder or s3:// prefix, and fetches
only the images it shows. Writes <out>/index.html (charts inlined as base64, so the page
travels alone), <out>/report.md and every chart as <out>/report_<name>.png beside them.
Needs matplotlib: pip install 'adt-tree[report]'.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from jobs.report_charts import MissingDependency, require_matplotlib
from jobs.report_data import JobData, image_png, job_json, load, ok_rows, pick_samples
from pipeline.cli import CliParser
from pipeline.config import StorageSettings
from pipeline.storage import Storage, StorageUnavailable, is_remote, open_storage, parse_uri

log = logging.getLogger("jobs.report")


@dataclass(frozen=True)
class Chart:
    name: str  # file stem: report_<name>.png
    title: str
    caption: str
    png: bytes


@dataclass(frozen=True)
class Report:
    html_path: Path
    markdown_path: Path
    charts: list[Chart]


def _stats(values: np.ndarray) -> dict[str, Optional[float]]:
    if not len(values):
        return {"n": 0, "mean": None, "p10": None, "p50": None, "p90": None}
    return {"n": len(values), "mean": float(np.mean(values)),
            **{f"p{q}": float(np.percentile(values, q)) for q in (10, 50, 90)}}


def key_numbers(data: JobData) -> list[tuple[str, dict[str, Optional[float]], str]]:
    from jobs.report_figs import _col

    ok = ok_rows(data.rows)
    return [
        ("engine time per image", _stats(_col(ok, "generation_time_ms") / 1000), "s"),
        ("AR baseline time per image", _stats(_col(ok, "baseline_time_ms") / 1000), "s"),
        ("measured speedup vs ar", _stats(_col(ok, "speedup")), "x"),
        ("estimated speedup", _stats(_col(ok, "estimated_speedup")), "x"),
        ("mean acceptance length", _stats(_col(ok, "mean_acceptance_length")), ""),
        ("draft acceptance rate", _stats(_col(ok, "draft_acceptance_rate")), ""),
    ]


def _f(x: Optional[float], unit: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}{unit}"


def build_charts(data: JobData, store, samples: int = 12) -> list[Chart]:
    from jobs import report_figs as rf

    picked = pick_samples(data.rows, samples)
    singles = list(data.maps.singles) if data.maps else []
    prompts = dict(zip(data.rows["prompt_id"].to_pylist(), data.rows["prompt"].to_pylist()))
    want = {r["prompt_id"]: r for r in picked}
    want.update({r["prompt_id"]: r for r in ok_rows(data.rows).select(["prompt_id", "image_key"]).to_pylist()
                 if r["prompt_id"] in set(singles)})
    images = {pid: b for pid, r in want.items() if (b := image_png(store, r)) is not None}
    n_maps = data.maps.images if data.maps else 0
    return [
        Chart("status", "Outcome", "Prompts by status (the latest row of each prompt across runs) and the most "
              "common failure reasons.", rf.status_chart(data.rows)),
        Chart("throughput", "Throughput", "Left: ok images finished by each actor over time (a flat line is an actor "
              "loading its bundle or waiting). Right: images per second of the whole job, per time bin.",
              rf.throughput_chart(data.rows)),
        Chart("time", "Time per image", "Engine time attributed to each image (solid line p50, dashed p90); the AR "
              "baseline where the job measured one.", rf.time_chart(data.rows)),
        Chart("speedup", "Speedup", "Measured speedup (baseline rows: AR decoded the same prompt) and the engine's "
              "estimate (every row); right: the cost model's own estimate (before it is scaled by the measured rows, "
              "which would agree with them by construction) against the measurement on the rows that have both.",
              rf.speedup_chart(data.rows)),
        Chart("acceptance", "Acceptance", "Tokens committed per target forward, per image and per round.",
              rf.acceptance_chart(data.rows)),
        Chart("tree_maps", "ADT-Tree maps (aggregate)", f"Mean draft depth, width and committed length at each token "
              f"of the grid, over {n_maps:,} images: where trees grow deep (predictable regions) or wide.",
              rf.aggregate_map_chart(data.maps)),
        Chart("tree_singles", "ADT-Tree maps (single images)", "The images with the lowest, median and highest "
              "acceptance beside their own maps (one colour scale per column).",
              rf.single_map_chart(data.maps, images, prompts)),
        Chart("samples", "Samples", f"{len(picked)} images spread over the job, with their prompts.",
              rf.sample_grid(picked, images)),
    ]


CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;background:#f4f5f7;color:#1f2328}
header{background:#1f2d3d;color:#fff;padding:22px 40px}header h1{margin:0 0 6px;font-size:24px}
header .sub{opacity:.8;font-size:14px}main{max-width:1180px;margin:0 auto;padding:20px 30px 60px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin:8px 0 20px}.card{background:#fff;border-radius:8px;
padding:12px 18px;box-shadow:0 1px 3px rgba(0,0,0,.08);min-width:130px}.card .v{font-size:22px;font-weight:600}
.card .k{font-size:12px;color:#57606a;text-transform:uppercase;letter-spacing:.04em}
section{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08);padding:16px 22px;margin:0 0 18px}
section h2{margin:0 0 4px;font-size:18px}section p.cap{margin:0 0 10px;color:#57606a;font-size:14px}
img{max-width:100%;display:block}table{border-collapse:collapse;font-size:14px;width:100%}
th,td{border-bottom:1px solid #e5e7eb;padding:6px 10px;text-align:right}th:first-child,td:first-child{text-align:left}
th{background:#f6f8fa}pre{background:#f6f8fa;padding:12px;border-radius:6px;overflow:auto;font-size:12px}
"""


def rate_cards(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The headline's throughput: over the whole run and while the engine ran; the steady rate
    only where the job's summary found a window that means something (pipeline.summary)."""
    cards = [("images/s (whole run)", _f(summary.get("images_per_second"))),
             ("images/s while decoding", _f(summary.get("decode_images_per_second")))]
    if summary.get("steady_images_per_second") is not None:
        cards.append(("steady images/s", _f(summary["steady_images_per_second"])))
    return cards + [("wall time", _f(summary.get("wall_time_s"), " s"))]


def render_html(data: JobData, charts: list[Chart]) -> str:
    cfg, s = data.config, data.summary
    ok = ok_rows(data.rows).num_rows
    failed = data.rows.num_rows - ok
    methods = sorted({m for m in data.rows["method"].to_pylist() if m})
    cards = [("prompts", f"{data.rows.num_rows:,}"), ("ok", f"{ok:,}"), ("failed", f"{failed:,}"),
             ("method", "/".join(methods) or "-"), ("bundle", str(cfg.get("bundle", "-")))] + rate_cards(s)
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Job report: {e(str(cfg.get('job_id', data.uri)))}</title>",
             f"<style>{CSS}</style></head><body><header><h1>Job report: {e(str(cfg.get('job_id', '')))}</h1>",
             f"<div class='sub'>{e(data.uri)} &middot; config {e(str(cfg.get('config_hash', '-')))} &middot; "
             f"{data.all_rows:,} telemetry rows</div></header><main><div class='cards'>"]
    parts += [f"<div class='card'><div class='k'>{e(k)}</div><div class='v'>{e(v)}</div></div>" for k, v in cards]
    parts.append("</div><section><h2>Key numbers</h2><p class='cap'>Over ok images (p10 / p50 / p90 across images).</p>"
                 "<table><tr><th>quantity</th><th>n</th><th>mean</th><th>p10</th><th>p50</th><th>p90</th></tr>")
    for name, st, unit in key_numbers(data):
        parts.append(f"<tr><td>{e(name)}</td><td>{st['n']:,}</td>" + "".join(
            f"<td>{_f(st[k], unit)}</td>" for k in ("mean", "p10", "p50", "p90")) + "</tr>")
    parts.append("</table></section>")
    for c in charts:
        b64 = base64.b64encode(c.png).decode()
        parts.append(f"<section id='{c.name}'><h2>{e(c.title)}</h2><p class='cap'>{e(c.caption)}</p>"
                     f"<img alt='{e(c.title)}' src='data:image/png;base64,{b64}'></section>")
    parts.append("<section><h2>Job config (job.json)</h2><pre>" + e(json.dumps(cfg, indent=2) if cfg else "(no job.json)")
                 + "</pre></section></main></body></html>")
    return "".join(parts)


def render_markdown(data: JobData, charts: list[Chart]) -> str:
    from jobs.report_figs import failure_reasons

    cfg = data.config
    ok = ok_rows(data.rows).num_rows
    lines = [f"# Job report: {cfg.get('job_id', data.uri)}", "", f"Output: `{data.uri}`; bundle `{cfg.get('bundle', '-')}`, "
             f"config `{cfg.get('config_hash', '-')}`; {data.all_rows:,} telemetry rows.", "",
             f"Prompts: {data.rows.num_rows:,}; ok {ok:,}; failed {data.rows.num_rows - ok:,}.", ""]
    reasons = failure_reasons(data.rows)
    if reasons:
        lines += ["| failures | reason |", "|---|---|"] + [f"| {n} | {r.replace('|', '/')} |" for r, n in reasons] + [""]
    lines += ["| quantity | n | mean | p10 | p50 | p90 |", "|---|---|---|---|---|---|"]
    for name, st, unit in key_numbers(data):
        lines.append(f"| {name} | {st['n']} | " + " | ".join(_f(st[k], unit) for k in ("mean", "p10", "p50", "p90")) + " |")
    lines.append("")
    for c in charts:
        lines += [f"## {c.title}", "", c.caption, "", f"![{c.title}](report_{c.name}.png)", ""]
    return "\n".join(lines)


def default_out(uri: str) -> Path:
    if is_remote(uri):
        return Path("reports") / (uri.rstrip("/").rsplit("/", 1)[-1] or "report")
    return Path(parse_uri(uri).path) / "report"


PROBE_BUDGET_S = 10.0  # seconds of retries reading job.json before the store counts as unreachable (exit 4)


def job_store(uri: str, settings: Optional[StorageSettings] = None) -> Storage:
    """The job's store, opened with the job's own storage settings: job.json is read first
    (with `settings`, else the AWS environment: AWS_ENDPOINT_URL, AWS_REGION, a profile) and
    its `storage` section (endpoint, region, profile, timeouts) serves every later read,
    unless `settings` were given. StorageUnavailable when job.json cannot be reached."""
    probe_settings = (settings or StorageSettings()).model_copy(update={"retry_budget_s": PROBE_BUDGET_S})
    probe = open_storage(uri, probe_settings)
    cfg = job_json(probe)  # raises StorageUnavailable: nothing else is tried against an unreachable store
    if settings is None and isinstance(cfg.get("storage"), dict):
        try:
            return open_storage(uri, StorageSettings(**cfg["storage"]))
        except (TypeError, ValueError):  # a job.json from another version: the environment's settings
            log.warning("job.json storage settings not usable; using the environment's")
    return open_storage(uri, settings)


def make_report(uri: str, out: Optional[Path] = None, settings: Optional[StorageSettings] = None,
                max_map_rows: int = 5000, samples: int = 12) -> Report:
    require_matplotlib()
    store = job_store(uri, settings)
    data = load(store, max_map_rows=max_map_rows)
    charts = build_charts(data, store, samples)
    out = Path(out) if out else default_out(uri)
    out.mkdir(parents=True, exist_ok=True)
    for c in charts:
        (out / f"report_{c.name}.png").write_bytes(c.png)
    (out / "index.html").write_text(render_html(data, charts))
    (out / "report.md").write_text(render_markdown(data, charts))
    return Report(out / "index.html", out / "report.md", charts)


def main(argv: Optional[list[str]] = None) -> int:
    p = CliParser("python -m jobs.report", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                  usage="python -m jobs.report OUTPUT [options]  (--help lists them)")
    p.add_argument("output", help="The job's output: a folder, file:// or s3:// URI.")
    p.add_argument("--out", type=Path, default=None, help="Report folder; default <output>/report (s3: ./reports/<name>).")
    p.add_argument("--endpoint-url", default=None, help="S3 endpoint to read the output from; default: the AWS "
                   "environment (AWS_ENDPOINT_URL, ...) for job.json, then job.json's storage settings.")
    p.add_argument("--max-map-rows", type=int, default=5000, help="Images averaged into the tree maps. [default: 5000]")
    p.add_argument("--samples", type=int, default=12, help="Images in the sample grid. [default: 12]")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jobs").setLevel(logging.INFO)
    settings = StorageSettings(endpoint_url=args.endpoint_url) if args.endpoint_url else None
    try:
        rep = make_report(args.output, args.out, settings, args.max_map_rows, args.samples)
    except MissingDependency as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except StorageUnavailable as e:
        where = f"{args.endpoint_url}" if args.endpoint_url else "the environment's S3 endpoint"
        print(f"error: cannot reach {args.output} at {where} ({str(e).splitlines()[0][:200]}): give the store's "
              "endpoint with --endpoint-url URL or AWS_ENDPOINT_URL", file=sys.stderr)
        return 4
    print(f"report: {rep.html_path}\nsummary: {rep.markdown_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
