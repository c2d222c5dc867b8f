"""Self-distilled training data: the target's own token grids for a prompt set.

The drafter is verified against the target's distribution, so it learns from images the target
drew itself (as EAGLE and HASS train on target outputs): the project's batch job
(pipeline.driver.run_job, i.e. `python -m jobs.generate`) decodes every prompt with method
`ar` at the bundle's sampling defaults and keeps each token grid in its telemetry. An earlier
run's output (a jobs.generate output root, or the `data/` of an earlier training run) is
reused as it is.

`load_grids` reads the ok rows of that telemetry into a `GridSet` and refuses what cannot be
trained on (no rows, every row failed, ids outside the codebook, another grid). `encode_prompts`
turns the distinct prompts into LlamaGen's caption rows once, on the driver (the bundle's
text encoder; cached beside the data); a token family's prompt rows come from its prompter
(jobs/train/token_pairs.py); the workers receive arrays, not a text encoder or a tokenizer.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from pipeline.config import JobConfig, StorageSettings, build_config
from pipeline.ledger import latest_per_prompt, read_telemetry
from pipeline.storage import Storage
from pipeline.telemetry import STATUS_OK

log = logging.getLogger(__name__)

COLUMNS = ["prompt_id", "prompt", "seed", "status", "error", "grid_h", "grid_w", "tokens", "finished_at"]


class DataError(ValueError):
    """The training data cannot be used (empty, every row failed, ids outside the codebook, wrong grid)."""


@dataclass
class GridSet:
    """Token grids with their prompts; row i is image i.

    tokens (N, L) int64 codes in raster order; prompt (N,) int64 index into `prompts`.
    """

    prompt_ids: list[str]
    seeds: list[int]
    tokens: torch.Tensor  # (N, L) long
    prompt: torch.Tensor  # (N,) long
    prompts: list[str]  # distinct prompts, first-seen order
    grid: tuple[int, int]
    failed: int  # rows whose latest attempt failed (not trained on)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def subset(self, keep: np.ndarray) -> "GridSet":
        idx = np.flatnonzero(keep)
        return GridSet([self.prompt_ids[i] for i in idx], [self.seeds[i] for i in idx], self.tokens[idx],
                       self.prompt[idx], self.prompts, self.grid, 0)


def data_job_config(bundle: str, prompts: str, output: str, num_actors: int, decode_batch_size: int,
                    storage: StorageSettings, ray_address: Optional[str], job_id: str) -> JobConfig:
    """The batch job that draws the target's own images: ar, the bundle's sampling defaults,
    resumable (a rerun skips prompts already done), failures kept as rows."""
    return build_config({
        "job_id": job_id, "input": prompts, "output": output, "bundle": bundle,
        "decode": {"method": "ar", "batch_size": decode_batch_size}, "num_actors": num_actors,
        "resume": True, "allow_failures": True, "progress": False, "progress_interval_s": 60.0,
        "storage": storage.model_dump(), "ray_address": ray_address,
    })


def load_grids(store: Storage, num_codes: int, grid: tuple[int, int]) -> GridSet:
    """The ok rows of a batch job's telemetry under `store` (latest attempt per prompt id)."""
    table = read_telemetry(store, columns=COLUMNS)
    if table is None or table.num_rows == 0:
        raise DataError(f"no telemetry rows under {store.uri_for('telemetry')}: the data set is empty")
    table = latest_per_prompt(table)
    ok = table.filter(pc.equal(table["status"], STATUS_OK))
    failed = table.num_rows - ok.num_rows
    if ok.num_rows == 0:
        errors = [e for e in table["error"].to_pylist() if e][:1]
        raise DataError(f"all {table.num_rows} rows under {store.uri} failed"
                        + (f" (first error: {errors[0][:200]})" if errors else ""))
    shapes = set(zip(ok["grid_h"].to_pylist(), ok["grid_w"].to_pylist()))
    if shapes != {tuple(grid)}:
        raise DataError(f"token grids {sorted(shapes)} in {store.uri}, the target generates {grid[0]}x{grid[1]}")
    flat = pc.list_flatten(ok["tokens"]).to_numpy(zero_copy_only=False).astype(np.int64)
    length = grid[0] * grid[1]
    if flat.size != ok.num_rows * length:
        raise DataError(f"{store.uri}: token lists do not all hold {length} ids")
    tokens = flat.reshape(ok.num_rows, length)
    bad = (tokens < 0) | (tokens >= num_codes)
    if bad.any():
        row = int(np.flatnonzero(bad.any(1))[0])
        raise DataError(f"token ids outside the codebook [0, {num_codes}) in {store.uri}: "
                        f"{int(bad.any(1).sum())} grid(s), e.g. prompt id {ok['prompt_id'][row].as_py()!r} "
                        f"holds {int(tokens[row][bad[row]][0])}")
    texts = ok["prompt"].to_pylist()
    order = {p: i for i, p in enumerate(dict.fromkeys(texts))}
    return GridSet(ok["prompt_id"].to_pylist(), [int(s) for s in ok["seed"].to_pylist()],
                   torch.from_numpy(tokens), torch.tensor([order[p] for p in texts], dtype=torch.long),
                   list(order), tuple(grid), failed)


def heldout_mask(prompt_ids: list[str], fraction: float) -> np.ndarray:
    """True for the prompt ids held out of training: sha256(id) in the lowest `fraction`."""
    cut = int(fraction * 10_000)
    return np.array([int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "big") % 10_000 < cut
                     for p in prompt_ids], dtype=bool)


# ---------------------------------------------------------------- caption rows


def prompts_key(prompts: list[str], spec: dict) -> str:
    digest = hashlib.sha256(json.dumps([spec, prompts]).encode()).hexdigest()[:16]
    return f"cache/captions-{digest}.npz"


@torch.no_grad()
def encode_prompts(encoder, prompts: list[str], batch_size: int = 256,
                   say: Callable[[str], None] = print) -> tuple[np.ndarray, np.ndarray]:
    """prompts (P,) -> caption states fp16 (P, T, C) and masks bool (P, T), as the engine encodes them."""
    states, masks = [], []
    for k in range(0, len(prompts), batch_size):
        emb, mask = encoder.encode(prompts[k:k + batch_size])  # (b, T, C), (b, T)
        states.append(emb.to(torch.float16).cpu().numpy())
        masks.append(mask.cpu().numpy().astype(bool))
        if len(prompts) > batch_size:
            say(f"captions {min(k + batch_size, len(prompts))}/{len(prompts)}")
    return np.concatenate(states), np.concatenate(masks)


def cached_captions(store: Storage, encoder, spec: dict, prompts: list[str],
                    say: Callable[[str], None] = print) -> tuple[np.ndarray, np.ndarray]:
    """encode_prompts, kept under `store` by a hash of the prompts and the text encoder spec."""
    key = prompts_key(prompts, spec)
    if store.exists(key):
        with np.load(io.BytesIO(store.get_bytes(key))) as f:
            return f["states"], f["masks"]
    states, masks = encode_prompts(encoder, prompts, say=say)
    buf = io.BytesIO()
    np.savez(buf, states=states, masks=masks)
    store.put_bytes(key, buf.getvalue(), "application/octet-stream")
    return states, masks


def worker_arrays(data: GridSet, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a training worker needs (numpy, for the object store): the grids, their prompt index
    and the head type's per-prompt arrays (jobs/train/heads.py `prompt_arrays`)."""
    return {"tokens": data.tokens.numpy(), "prompt": data.prompt.numpy(), **rows}


def table_of(data: GridSet) -> pa.Table:
    """The grid set as a table (prompt_id, prompt, seed): the held-out prompts for evaluation."""
    return pa.table({"prompt_id": data.prompt_ids, "prompt": [data.prompts[i] for i in data.prompt.tolist()],
                     "seed": pa.array(data.seeds, pa.int64())})
