"""Per-image telemetry: the Arrow schema (defined once, here), result -> row, and the summary.

One row per prompt and attempt that finished. Column names follow the peers (vLLM's
mean_acceptance_length / draft_acceptance_rate / num_spec_steps / num_draft_tokens /
num_accepted_draft_tokens) so reports read like theirs.

Vocabulary (adt_core/results.py): a *round* is one draft + verify step of the speculative
loop. It commits its accepted drafted tokens plus one bonus token from the target.
`accepted_lengths` and a round's `accepted` count accepted DRAFTED tokens (bonus excluded);
`mean_acceptance_length` is tokens committed per round, 1 + accepted / rounds (bonus
included: 1.0 for vanilla AR).

Rows are built from the engine's typed results (`GenerationResult`, `StepStats`,
`RoundTrace`), whose fields are read directly: a renamed field fails, never reads as 0.
"""

from __future__ import annotations

import datetime as dt
import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:  # the driver reads rows without importing torch
    from adt_core.results import GenerationResult, RoundTrace

TELEMETRY_DIR = "telemetry"
LIKE_FOR_LIKE = 0.10  # a measured speedup needs the AR baseline within this fraction of the image's occupancy
STATUS_OK = "ok"
STATUS_FAILED = "failed"

ROUND_TYPE = pa.struct(
    [
        ("position", pa.int32()),  # index of the first token this round decides
        ("depth", pa.int16()),  # draft tree depth used
        ("width", pa.int16()),  # draft tree width (top-k) used
        ("nodes", pa.int32()),  # draft nodes verified
        ("accepted", pa.int16()),  # accepted drafted tokens (bonus token not counted)
        ("draft_ms", pa.float32()),
        ("verify_ms", pa.float32()),
    ]
)

# (name, type, description): the single definition of the telemetry table.
COLUMNS: list[tuple[str, pa.DataType, str]] = [
    ("job_id", pa.string(), "job id (JobConfig.job_id)"),
    ("run_id", pa.string(), "the run (one invocation of the job) that produced the row"),
    ("prompt_id", pa.string(), "prompt id from the input"),
    ("prompt", pa.string(), "the prompt text (the image's caption)"),
    ("seed", pa.int64(), "seed used (the input's, or derived from the prompt id when absent); null if invalid"),
    ("status", pa.string(), "ok | failed"),
    ("error", pa.string(), "why the row failed (null when ok)"),
    ("image_key", pa.string(), "where the image is, under the output root: images/<sanitised prompt id>.png, or the "
     "shard holding it (shards/<name>.tar | .parquet, sample key = sanitised prompt id); null when failed"),
    ("width", pa.int32(), "image width in pixels (null when failed)"),
    ("height", pa.int32(), "image height in pixels (null when failed)"),
    ("bundle", pa.string(), "model bundle name"),
    ("method", pa.string(), "decoding method: ar | static | eagle2 | adt"),
    ("config_hash", pa.string(), "hash of what decides the images (JobConfig.config_hash)"),
    ("lossy", pa.bool_(), "true when acceptance was relaxed (LANTERN): output may differ from the target's distribution"),
    ("sampler", pa.string(), "what drew the tokens: greedy (temperature 0) | coupled | rejection (null when the engine does not say)"),
    ("grid_h", pa.int16(), "token grid height"),
    ("grid_w", pa.int16(), "token grid width"),
    ("tokens", pa.list_(pa.int16()), "token grid, row-major, grid_h * grid_w ids"),
    ("num_spec_steps", pa.int64(), "rounds of a speculative method (draft + verify; plain steps the budget chose "
     "count with 0 drafted); 0 for vanilla AR"),
    ("num_target_forwards", pa.int64(), "target forward passes, prefill included"),
    ("num_draft_forwards", pa.int64(), "drafter forward passes"),
    ("num_draft_tokens", pa.int64(), "draft tokens verified by the target"),
    ("num_accepted_draft_tokens", pa.int64(), "drafted tokens accepted (bonus tokens not counted)"),
    ("mean_acceptance_length", pa.float64(), "tokens committed per round: 1 + num_accepted_draft_tokens / "
     "num_spec_steps (the bonus token included; 1.0 for vanilla AR)"),
    ("draft_acceptance_rate", pa.float64(), "num_accepted_draft_tokens / num_draft_tokens (null without drafts)"),
    ("accepted_lengths", pa.list_(pa.int16()), "accepted drafted tokens per round (bonus token not counted)"),
    ("generation_time_ms", pa.float64(), "engine time for this image (an AR batch's shared time is split evenly)"),
    ("draft_time_ms", pa.float64(), "time spent drafting"),
    ("verify_time_ms", pa.float64(), "time spent in target verification"),
    ("in_flight", pa.float64(), "images in flight in this image's rounds (mean over its rounds; for vanilla AR the "
     "engine's capacity in this worker call)"),
    ("baseline_time_ms", pa.float64(), "vanilla AR time for the same prompt and seed, decoded with baseline_in_flight "
     "images in flight (baseline rows only)"),
    ("baseline_in_flight", pa.float64(), "images in flight in the AR baseline's rounds (baseline rows only): the "
     "measured prompts decoded together with other prompts of the worker call, filled to the engine's occupancy"),
    ("speedup", pa.float64(), "baseline_time_ms / generation_time_ms, measured like for like: null unless "
     "baseline_in_flight is within 10% of in_flight (the same occupancy; baseline rows only)"),
    ("baseline_tokens_match", pa.bool_(), "the AR baseline produced the same token grid (baseline rows only)"),
    ("estimated_speedup", pa.float64(), "speedup over batched AR estimated from the rounds and the cost table, scaled by "
     "the median measured/modelled ratio of the rows of the same worker batch that have a like-for-like measured "
     "speedup (see estimate_source; on those rows it agrees with the measurement by construction)"),
    ("estimated_speedup_model", pa.float64(), "the cost-table model's estimate alone (before the scaling above)"),
    ("estimate_source", pa.string(), "'model' or 'calibrated on N measured rows' (N rows of the same worker batch, "
     "measured at the same occupancy)"),
    ("rounds", pa.list_(ROUND_TYPE), "per-round trace: position, depth, width, nodes, accepted, draft_ms, verify_ms"),
    ("actor_id", pa.string(), "Ray actor that produced the row (local outside Ray)"),
    ("node_id", pa.string(), "Ray node id (local outside Ray)"),
    ("hostname", pa.string(), "host name of the worker"),
    ("device", pa.string(), "torch device, e.g. cuda:0 (NVIDIA H100 ...) or cpu"),
    ("finished_at", pa.timestamp("ms", tz="UTC"), "when the row was produced"),
]

SCHEMA = pa.schema([pa.field(name, typ, metadata={"doc": doc}) for name, typ, doc in COLUMNS])

# The row columns that travel with each image (json in a tar, columns in parquet and metadata).
SAMPLE_COLUMNS = [
    "prompt_id", "prompt", "seed", "width", "height", "job_id", "run_id", "bundle", "method", "sampler",
    "config_hash", "lossy", "grid_h", "grid_w", "num_spec_steps", "mean_acceptance_length",
    "draft_acceptance_rate", "generation_time_ms", "speedup", "estimated_speedup", "finished_at",
]

COLUMN_NAMES = [name for name, _, _ in COLUMNS]


@dataclass(frozen=True)
class RowContext:
    """What every row of one worker shares."""

    job_id: str
    bundle: str
    method: str
    config_hash: str
    run_id: Optional[str] = None
    actor_id: str = "local"
    node_id: str = "local"
    hostname: str = ""
    device: str = "cpu"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _base_row(ctx: RowContext, prompt_id: str, seed: Optional[int], prompt: Optional[str]) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(COLUMN_NAMES)
    row.update(
        job_id=ctx.job_id, run_id=ctx.run_id, prompt_id=prompt_id, prompt=prompt, seed=seed, bundle=ctx.bundle, method=ctx.method,
        config_hash=ctx.config_hash, actor_id=ctx.actor_id, node_id=ctx.node_id, hostname=ctx.hostname,
        device=ctx.device, finished_at=_now(),
    )
    return row


def failed_row(ctx: RowContext, prompt_id: str, seed: Optional[int], error: str,
               prompt: Optional[str] = None) -> dict[str, Any]:
    row = _base_row(ctx, prompt_id, seed, prompt if isinstance(prompt, str) else None)
    row.update(status=STATUS_FAILED, error=error[:2000])
    return row


def _opt_float(x: Any) -> Optional[float]:
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def tokens_to_list(tokens: Any) -> tuple[int, int, list[int]]:
    """(H, W, row-major ids) of a (H, W) token grid (torch tensor or array)."""
    arr = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if arr.ndim != 2:
        raise ValueError(f"token grid must be 2-D (H, W), got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np.int16).max):
        raise ValueError(f"token ids outside int16 range [{arr.min()}, {arr.max()}]")
    return int(arr.shape[0]), int(arr.shape[1]), arr.astype(np.int16).reshape(-1).tolist()


def _round(r: "RoundTrace") -> dict[str, Any]:
    """One round of the engine's trace -> the `rounds` struct (ROUND_TYPE)."""
    return {"position": r.position, "depth": r.depth, "width": r.width, "nodes": r.nodes, "accepted": r.accepted,
            "draft_ms": r.draft_ms, "verify_ms": r.verify_ms}


def image_size(image: Any) -> tuple[Optional[int], Optional[int]]:
    """(width, height) in pixels of a uint8 (H, W, 3) array or a PIL image."""
    if image is None:
        return None, None
    if hasattr(image, "size") and not hasattr(image, "shape"):
        return int(image.size[0]), int(image.size[1])
    shape = getattr(image, "shape", None)
    return (int(shape[1]), int(shape[0])) if shape is not None and len(shape) >= 2 else (None, None)


def ok_row(ctx: RowContext, prompt_id: str, seed: int, image_key: Optional[str], result: "GenerationResult",
           prompt: Optional[str] = None) -> dict[str, Any]:
    """The row of one successful GenerationResult (tokens, image already stored, stats)."""
    s = result.stats
    row = _base_row(ctx, prompt_id, seed, prompt)
    h, w, ids = tokens_to_list(result.tokens)
    row["width"], row["height"] = image_size(result.image)
    row.update(
        status=STATUS_OK,
        image_key=image_key,
        lossy=s.lossy,
        sampler=s.sampler,
        grid_h=h,
        grid_w=w,
        tokens=ids,
        num_spec_steps=s.num_spec_steps,
        num_target_forwards=s.target_forwards,
        num_draft_forwards=s.draft_forwards,
        num_draft_tokens=s.draft_tokens,
        num_accepted_draft_tokens=s.accepted_draft_tokens,
        mean_acceptance_length=s.mean_acceptance_length,
        draft_acceptance_rate=(s.accepted_draft_tokens / s.draft_tokens) if s.draft_tokens else None,  # null, not 0
        accepted_lengths=list(s.accepted_lengths),
        generation_time_ms=s.total_ms,
        draft_time_ms=s.draft_ms,
        verify_time_ms=s.verify_ms,
        estimated_speedup=_opt_float(s.estimated_speedup),
        rounds=[_round(r) for r in s.rounds],
        in_flight=mean_in_flight(s),
    )
    return row


def mean_in_flight(stats: Any) -> float:
    """Images in flight in an image's rounds (mean over its traced rounds; untraced: the
    engine's capacity)."""
    r = stats.rounds
    if len(r):
        slots = r.ints[:, 5] if hasattr(r, "ints") else np.array([x.slots for x in r])
        return float(np.mean(slots))
    return float(stats.batch_size)


def like_for_like(in_flight: Optional[float], baseline_in_flight: Optional[float]) -> bool:
    """The AR baseline ran at the image's occupancy (within LIKE_FOR_LIKE); unknown counts as
    the same."""
    if not in_flight or not baseline_in_flight:
        return True
    return abs(baseline_in_flight / in_flight - 1.0) <= LIKE_FOR_LIKE


def add_baseline(row: dict[str, Any], baseline: "GenerationResult", baseline_in_flight: Optional[float] = None) -> None:
    """Record a vanilla AR decode of the same prompt: its time, its occupancy, the measured
    speedup (only like for like: AR at the image's occupancy), and whether it produced the
    same tokens."""
    base_ms = baseline.stats.total_ms
    row["baseline_time_ms"] = base_ms
    row["baseline_in_flight"] = baseline_in_flight
    gen_ms = row.get("generation_time_ms")
    same = like_for_like(row.get("in_flight"), baseline_in_flight)
    row["speedup"] = (base_ms / gen_ms) if base_ms and gen_ms and same else None
    _, _, ids = tokens_to_list(baseline.tokens)
    row["baseline_tokens_match"] = ids == row.get("tokens")


def calibrate_estimates(rows: list[dict[str, Any]]) -> None:
    """Scale each ok row's modelled estimated_speedup by the median of measured / modelled over
    the rows that have both (the same worker batch: same device and load; `speedup` is only set
    where the baseline ran at the image's occupancy, so only like-for-like rows count), and say
    which estimate a row carries in estimate_source."""
    pairs = [r["speedup"] / r["estimated_speedup"] for r in rows
             if r.get("speedup") and r.get("estimated_speedup")]
    factor = statistics.median(pairs) if pairs else None
    for r in rows:
        if r.get("estimated_speedup") is None:
            continue
        r["estimated_speedup_model"] = r["estimated_speedup"]
        if factor is not None:
            r["estimated_speedup"] = r["estimated_speedup"] * factor
            r["estimate_source"] = f"calibrated on {len(pairs)} measured rows"
        else:
            r["estimate_source"] = "model"


def to_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=SCHEMA)


def empty_table() -> pa.Table:
    return SCHEMA.empty_table()
