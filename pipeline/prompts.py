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

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

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
    ids: list[str]  # every prompt id, in file order

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


def _scan_ids(storage: Storage, fs: pafs.FileSystem, path: str, columns: list[str]) -> list[Optional[str]]:
    """Decode every page of `columns` of one file (streaming) and return its prompt ids."""

    def scan() -> list[Optional[str]]:
        ids: list[Optional[str]] = []
        with fs.open_input_file(path) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=_SCAN_ROWS, columns=columns):
                ids.extend(batch.column(ID_COLUMN).to_pylist())
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

    ids: list[str] = []
    bad: list[str] = []
    for path in paths:
        try:
            values = _scan_ids(storage, fs, path, columns)  # every page of every column the job reads
        except PromptInputError as e:
            bad.append(str(e).split("\n  ", 1)[-1])
            continue
        n_bad = sum(1 for v in values if v is None or v.strip() == "")
        if n_bad:
            bad.append(f"{path}: {n_bad} null or empty prompt_id value(s)")
        ids.extend(v for v in values if v is not None and v.strip() != "")
    if bad:
        raise PromptInputError("prompt input refused:\n  " + "\n  ".join(bad))
    if not ids:
        raise PromptInputError(f"prompt input refused: no prompts (0 rows) in {storage.uri}")
    dupes = [(i, n) for i, n in Counter(ids).items() if n > 1]
    if dupes:
        named = ", ".join(f"{i!r} x{n}" for i, n in dupes[:_MAX_NAMED])
        more = f" and {len(dupes) - _MAX_NAMED} more" if len(dupes) > _MAX_NAMED else ""
        raise PromptInputError(f"prompt input refused: {len(dupes)} duplicate prompt_id value(s): {named}{more}")
    return PromptSource(uri=storage.uri, filesystem=fs, paths=paths, columns=columns, ids=ids)


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


def select_ids(source: PromptSource, limit: Optional[int], done: set[str]) -> tuple[list[str], int]:
    """(ids to generate, number skipped as already done) among the first `limit` ids."""
    wanted = source.ids[:limit] if limit else source.ids
    todo = [i for i in wanted if i not in done]
    return todo, len(wanted) - len(todo)


def keep_ids(batch: pa.Table, ids: pa.Array) -> pa.Table:
    """The rows of `batch` whose prompt_id is in `ids`. The driver's Ray Data tasks run it: it
    lives here, not in execute.py, because a task worker imports the module of the function it
    runs, and execute.py's imports reach torch (~4 s for every fresh worker on a small machine)."""
    return batch.filter(pc.is_in(batch["prompt_id"], value_set=ids))
