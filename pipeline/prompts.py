"""Prompt input: find, validate and select Parquet prompts.

Input: one Parquet file, a folder of them, or an s3:// prefix, with columns

    prompt_id  string, unique, non-empty     (names the outputs)
    prompt     string                        (the caption)
    seed       integer, optional             (absent or null: derived from prompt id + JobConfig.seed)

Two kinds of bad input, treated differently:
- Structural problems (no files, no rows, a missing column, wrong column types, null/empty
  or duplicate ids, a damaged file) stop the job before any work, with a message naming
  what is wrong. Validation decodes every page of every column the job will read,
  streaming (one record batch at a time), so a file that would fail mid-run fails here.
- The store being unreachable is neither: it raises StorageUnavailable (exit code 4).
- Per-row problems (null, empty or over-long prompt, seed out of range) become failed
  telemetry rows with their reason (`row_problem`); the rest of the job goes on.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline.idset import MAX_SALT_TRIES, IdSet, id_hashes
from pipeline.retry import StorageUnavailable, call_with_retry, is_transient
from pipeline.storage import Storage, open_storage

log = logging.getLogger(__name__)

ID_COLUMN = "prompt_id"
PROMPT_COLUMN = "prompt"
SEED_COLUMN = "seed"
REQUIRED_COLUMNS = (ID_COLUMN, PROMPT_COLUMN)
MIN_SEED, MAX_SEED = 0, 2**63 - 1
_MAX_NAMED = 10  # ids named in an error message
_SCAN_ROWS = 65_536  # rows decoded at a time while validating
# pyarrow reports these as OSError, but they mean the store refused, not that the file is bad.
_STORE_REFUSALS = ("ACCESS_DENIED", "NO_SUCH_BUCKET", "NoSuchBucket", "AccessDenied", "InvalidAccessKeyId")


class PromptInputError(ValueError):
    """The prompt input cannot be used at all; nothing was generated."""


@dataclass
class PromptSource:
    """A validated prompt input."""

    uri: str
    filesystem: pafs.FileSystem
    paths: list[str]  # Parquet files, in read order
    columns: list[str]  # columns to read: prompt_id, prompt[, seed]
    ids: Optional[pa.ChunkedArray]  # every prompt id, in file order (Arrow: its bytes + 4 a prompt); None once released
    count: int = 0  # prompts in the input
    salt: int = 0  # the hash salt under which every id hashes apart (pipeline.idset)
    hashes: Optional[np.ndarray] = None  # id_hashes(ids, salt), in file order; None once released
    storage_settings: Any = None  # how the input store is reached (to read the ids again)

    def release(self) -> None:
        """Drop the per-prompt arrays (the selection is made): `ids_in` reads the ids again."""
        self.ids, self.hashes = None, None

    @property
    def has_seed(self) -> bool:
        return SEED_COLUMN in self.columns


def _is_data_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return not name.startswith((".", "_")) and name.endswith((".parquet", ".pq"))


def list_parquet_files(storage: Storage) -> list[str]:
    """The Parquet files at the storage root: the file itself, or every *.parquet below it."""
    fs, root = storage.arrow_fs(), storage.arrow_path()
    info = storage._call("stat", "", lambda: fs.get_file_info(root))
    if info.type == pafs.FileType.File:
        return [root]
    if info.type == pafs.FileType.NotFound:
        raise PromptInputError(f"prompt input not found: {storage.uri}")
    infos = storage._call("list", "", lambda: fs.get_file_info(pafs.FileSelector(root, recursive=True)))
    return sorted(i.path for i in infos if i.type == pafs.FileType.File and _is_data_file(i.path))


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _check_schema(path: str, schema: pa.Schema) -> list[str]:
    problems = []
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        problems.append(f"{path}: missing column(s) {', '.join(missing)} (has: {', '.join(schema.names) or 'none'})")
    for c in REQUIRED_COLUMNS:
        if c in schema.names and not (_is_string(schema.field(c).type) or pa.types.is_null(schema.field(c).type)):
            problems.append(f"{path}: column {c} must be string, got {schema.field(c).type}")
    if SEED_COLUMN in schema.names:
        t = schema.field(SEED_COLUMN).type
        if not (pa.types.is_integer(t) or pa.types.is_null(t)):
            problems.append(f"{path}: column seed must be an integer type, got {t}")
    return problems


def _read_file(storage: Storage, fs: pafs.FileSystem, path: str, what: str, read):
    """read() of one input file: transient store failures retried, a store that is gone or
    refuses -> StorageUnavailable, anything else (a damaged file) -> PromptInputError."""
    uri = f"{storage.location.scheme}://{path}" if storage.location.scheme == "s3" else path
    try:
        return call_with_retry(read, uri=uri, what=what, budget_s=storage.retry_budget_s)
    except StorageUnavailable as e:
        cause = e.__cause__
        if cause is not None and (is_transient(cause) or any(t in str(cause) for t in _STORE_REFUSALS)):
            raise
        if cause is not None and not isinstance(cause, OSError):
            raise
        raise PromptInputError(f"prompt input refused:\n  {path}: not a readable Parquet file ({e.cause})") from None
    except Exception as e:  # noqa: BLE001 - corrupt pages, bad thrift, wrong magic: a damaged file
        raise PromptInputError(f"prompt input refused:\n  {path}: not a readable Parquet file "
                               f"({type(e).__name__}: {str(e).strip()[:300]})") from None


def _scan_ids(storage: Storage, fs: pafs.FileSystem, path: str, columns: list[str]) -> list[pa.Array]:
    """Decode every page of `columns` of one file (streaming) and return its prompt ids (Arrow
    arrays, as read: nulls included)."""

    def scan() -> list[pa.Array]:
        ids: list[pa.Array] = []
        with fs.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=_SCAN_ROWS, columns=columns):
                col = batch.column(ID_COLUMN)
                ids.append(col.cast(pa.string()) if not pa.types.is_string(col.type) else col)
        return ids

    return _read_file(storage, fs, path, "read", scan)


def open_prompts(uri: str, storage_settings: Any = None) -> PromptSource:
    """Find and validate the prompt input at `uri`. Raises PromptInputError naming every
    structural problem (missing/mistyped columns, null/empty/duplicate ids, damaged files,
    no rows), StorageUnavailable when the store cannot be reached."""
    storage = open_storage(uri, storage_settings)
    paths = list_parquet_files(storage)
    if not paths:
        raise PromptInputError(f"no Parquet files (*.parquet) under {storage.uri}")
    fs = storage.arrow_fs()
    problems: list[str] = []
    with_seed = []
    for path in paths:
        try:
            schema = _read_file(storage, fs, path, "read schema", lambda p=path: pq.read_schema(p, filesystem=fs))
        except PromptInputError as e:
            problems.append(str(e).split("\n  ", 1)[-1])
            continue
        problems += _check_schema(path, schema)
        with_seed.append(SEED_COLUMN in schema.names)
    if with_seed and any(with_seed) and not all(with_seed):
        problems.append("column seed is present in some files but not others: add it everywhere or nowhere")
    if problems:
        raise PromptInputError("prompt input refused:\n  " + "\n  ".join(problems))
    columns = list(REQUIRED_COLUMNS) + ([SEED_COLUMN] if with_seed and all(with_seed) else [])

    chunks: list[pa.Array] = []
    bad: list[str] = []
    for path in paths:
        try:
            values = _scan_ids(storage, fs, path, columns)  # every page of every column the job reads
        except PromptInputError as e:
            bad.append(str(e).split("\n  ", 1)[-1])
            continue
        n_bad = 0
        for v in values:
            blank = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(v), ""), True)  # null or whitespace only
            here = pc.sum(blank).as_py() or 0
            n_bad += here
            chunks.append(v.filter(pc.invert(blank)) if here else v)
        if n_bad:
            bad.append(f"{path}: {n_bad} null or empty prompt_id value(s)")
    if bad:
        raise PromptInputError("prompt input refused:\n  " + "\n  ".join(bad))
    ids = pa.chunked_array(chunks, pa.string())
    if not len(ids):
        raise PromptInputError(f"prompt input refused: no prompts (0 rows) in {storage.uri}")
    salt, hashes = _unique_hashes(ids)
    return PromptSource(uri=storage.uri, filesystem=fs, paths=paths, columns=columns, ids=ids, count=len(ids),
                        salt=salt, hashes=hashes, storage_settings=storage_settings)


def _unique_hashes(ids: pa.ChunkedArray) -> tuple[int, np.ndarray]:
    """(salt, the ids' hashes under it) for the first salt under which no two ids hash alike
    (pipeline.idset); ids that repeat are refused, naming them. Two ids with one hash are
    compared as strings: equal, a duplicate; not, a collision (the next salt is tried)."""
    for salt in range(MAX_SALT_TRIES):
        h = id_hashes(ids, salt)
        s = np.sort(h)
        repeats = np.unique(s[1:][s[1:] == s[:-1]])
        del s
        if not len(repeats):
            return salt, h
        same = Counter(ids.filter(pa.array(np.isin(h, repeats))).to_pylist())
        dupes = [(i, n) for i, n in same.items() if n > 1]
        if dupes:
            _refuse_duplicates(dupes)
    raise PromptInputError(f"prompt input refused: the prompt ids collide under {MAX_SALT_TRIES} hash salts")


def _refuse_duplicates(dupes: list[tuple[str, int]]) -> None:
    """PromptInputError naming repeated ids."""
    named = ", ".join(f"{i!r} x{n}" for i, n in dupes[:_MAX_NAMED])
    more = f" and {len(dupes) - _MAX_NAMED} more" if len(dupes) > _MAX_NAMED else ""
    raise PromptInputError(f"prompt input refused: {len(dupes)} duplicate prompt_id value(s): {named}{more}")


# ----------------------------------------------------------------------------------------
# Per-row checks


def row_problem(prompt: Optional[str], seed: Optional[int], max_chars: int) -> Optional[str]:
    """Why this row cannot be generated, or None when it can."""
    if prompt is None:
        return "invalid prompt: null"
    if not prompt.strip():
        return "invalid prompt: empty"
    if len(prompt) > max_chars:
        return f"invalid prompt: {len(prompt)} characters, over the limit of {max_chars} (max_prompt_chars)"
    if seed is not None and not (MIN_SEED <= seed <= MAX_SEED):
        return f"invalid seed: {seed} outside [{MIN_SEED}, 2**63 - 1]"
    return None


def derived_seed(prompt_id: str, base_seed: int) -> int:
    """The seed of a prompt without one: a pure function of (prompt id, JobConfig.seed)."""
    digest = hashlib.sha256(f"{base_seed}\x00{prompt_id}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------
# Resume and selection


@dataclass
class Selection:
    """The prompts a run generates, as a compact id set (pipeline.idset), and what was skipped."""

    todo: IdSet  # the ids to generate (hashes under a salt unique over the whole input)
    skipped: int  # selected ids already done
    everything: bool  # todo is every input prompt: the prompt read needs no filter

    @property
    def wanted(self) -> int:
        return len(self.todo) + self.skipped


def select(source: PromptSource, limit: Optional[int], done: Optional[pa.Array] = None) -> Selection:
    """The first `limit` prompts (all without one) less the `done` ids: Arrow and numpy only."""
    salt = source.salt
    n = min(limit, source.count) if limit else source.count
    hashes = source.hashes[:n]
    skip = 0
    if done is not None and len(done):
        is_done = pc.is_in(source.ids.slice(0, n), value_set=done).to_numpy(zero_copy_only=False)
        skip = int(is_done.sum())
        hashes = hashes[~is_done]
    return Selection(IdSet(hashes, salt), skip, everything=len(hashes) == source.count)


def select_ids(source: PromptSource, limit: Optional[int], done: set[str]) -> tuple[list[str], int]:
    """(ids to generate, number skipped as already done) among the first `limit` ids, as
    Python lists: for small inputs and tests (`select` is what the driver uses)."""
    sel = select(source, limit, pa.array(sorted(done), pa.string()) if done else None)
    return ids_in(source, sel.todo), sel.skipped


def ids_in(source: PromptSource, ids: IdSet) -> list[str]:
    """The input ids that are members of `ids`, in input order (read again when released)."""
    if source.ids is not None:
        return source.ids.filter(pa.array(ids.contains(source.ids))).to_pylist()
    storage = open_storage(source.uri, source.storage_settings)
    out: list[str] = []
    for path in source.paths:
        for chunk in _scan_ids(storage, source.filesystem, path, [ID_COLUMN]):
            out += chunk.filter(pa.array(ids.contains(chunk))).to_pylist()  # validated: no null ids
    return out
