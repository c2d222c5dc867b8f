"""LANTERN codebook neighbours: for each VQ code, the k nearest other codes.

Distances are L2 between the RAW codebook vectors (before the L2 normalisation used at lookup).
The table is (V, k) and computed in row chunks (V = 16384 would need a 1 GB distance matrix at
once); it is cached on disk per tokenizer, keyed by a hash of the codebook, under
$ADT_CACHE_DIR (default ~/.cache/adt-tree)/lantern/.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from adt_core.config import LanternConfig
from adt_core.families.weights import CheckpointError
from adt_core.round.verify import Relaxation


def cache_dir() -> Path:
    return Path(os.environ.get("ADT_CACHE_DIR", Path.home() / ".cache" / "adt-tree")) / "lantern"


def nearest_codes(codebook: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """codebook (V, e) -> (V, k) long: the k nearest other codes of each code, nearest first."""
    cb = codebook.detach().float().cpu()
    v = cb.shape[0]
    k = min(k, v - 1)
    sq = (cb * cb).sum(1)  # (V,)
    out = torch.empty(v, k, dtype=torch.long)
    for s in range(0, v, chunk):
        rows = cb[s : s + chunk]  # (c, e)
        d = sq[s : s + chunk, None] - 2 * rows @ cb.T + sq[None]  # (c, V) squared distances
        d[torch.arange(rows.shape[0]), torch.arange(s, s + rows.shape[0])] = float("inf")  # not itself
        out[s : s + chunk] = torch.topk(d, k, dim=1, largest=False).indices  # sorted nearest first
    return out


def codebook_key(codebook: torch.Tensor) -> str:
    return hashlib.sha256(codebook.detach().float().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def neighbour_table(codebook: torch.Tensor, k: int) -> torch.Tensor:
    """Cached `nearest_codes`: read from disk when this codebook's table was built before."""
    path = cache_dir() / f"{codebook_key(codebook)}_k{k}.safetensors"
    if path.exists():
        return load_file(str(path))["neighbours"].long()
    table = nearest_codes(codebook, k)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"neighbours": table.to(torch.int32)}, str(tmp))
    tmp.replace(path)
    return table


def relaxation_for(codebook: torch.Tensor, cfg: LanternConfig, device: torch.device | str) -> Relaxation:
    return Relaxation(neighbour_table(codebook, cfg.k).to(device), delta=cfg.delta, lam=cfg.lam)


def load_neighbours(path: str | Path, k: int | None = None, num_codes: int | None = None) -> torch.Tensor:
    """LANTERN's top_{V-1}_indices.npy -> (V, k) long codes, nearest first (row c: code c's
    neighbours), the `neighbours` of adt_core.round.verify.Relaxation. Read memory-mapped: only the
    first k columns are copied (the 8192 x 8191 table is 134 MB as uint16)."""
    p = Path(path)
    table = np.load(p, mmap_mode="r", allow_pickle=False)
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.integer):
        raise CheckpointError(f"{p}: expected a 2-D integer table, got {table.dtype} {table.shape}")
    v, width = table.shape
    if num_codes is not None and v != num_codes:
        raise CheckpointError(f"{p}: {v} rows, the codebook has {num_codes} codes")
    k = width if k is None else k
    if not 1 <= k <= width:
        raise CheckpointError(f"{p}: {width} neighbours per code, {k} asked")
    out = torch.from_numpy(np.ascontiguousarray(table[:, :k]).astype(np.int64))
    if int(out.min()) < 0 or int(out.max()) >= v:
        raise CheckpointError(f"{p}: codes outside 0..{v - 1}")
    if bool((out == torch.arange(v)[:, None]).any()):
        raise CheckpointError(f"{p}: a code lists itself as a neighbour")
    return out
