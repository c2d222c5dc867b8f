import pyarrow as pa
import pytest

from pipeline.config import StorageSettings
from pipeline.prompts import (
    MAX_SEED,
    PromptInputError,
    derived_seed,
    open_prompts,
    row_problem,
    select_ids,
)
from pipeline.ledger import done_ids
from pipeline.storage import open_storage
from pipeline.telemetry import RowContext, failed_row, to_table
from pipeline_helpers import simple_rows, write_prompts


def test_single_file(tmp_path):
    f = write_prompts(tmp_path / "p.parquet", simple_rows(5))
    src = open_prompts(str(f))
    assert src.ids.to_pylist() == [f"p{i:03d}" for i in range(5)]
    assert src.columns == ["prompt_id", "prompt", "seed"] and src.has_seed


def test_folder_of_files_ignores_hidden_and_markers(tmp_path):
    write_prompts(tmp_path / "in" / "b.parquet", simple_rows(2, start=2))
    write_prompts(tmp_path / "in" / "sub" / "a.parquet", simple_rows(2))
    (tmp_path / "in" / "_SUCCESS").write_text("")
    (tmp_path / "in" / ".hidden.parquet").write_text("junk")
    src = open_prompts(str(tmp_path / "in"))
    assert len(src.paths) == 2 and sorted(src.ids.to_pylist()) == ["p000", "p001", "p002", "p003"]


def test_seed_column_optional(tmp_path):
    rows = [{"prompt_id": "x", "prompt": "cat"}]
    src = open_prompts(str(write_prompts(tmp_path / "p.parquet", rows)))
    assert src.columns == ["prompt_id", "prompt"] and not src.has_seed


def test_s3_prefix(s3):
    store = open_storage(f"s3://{s3.bucket}/prompts", StorageSettings(endpoint_url=s3.endpoint))
    store.write_parquet("part-0.parquet", pa.Table.from_pylist(simple_rows(3)))
    store.write_parquet("part-1.parquet", pa.Table.from_pylist(simple_rows(2, start=3)))
    src = open_prompts(f"s3://{s3.bucket}/prompts", StorageSettings(endpoint_url=s3.endpoint))
    assert len(src.paths) == 2 and len(src.ids) == 5


@pytest.mark.parametrize(
    "rows, schema, needle",
    [
        ([{"prompt_id": "a", "text": "x"}], None, "missing column(s) prompt"),
        ([{"id": "a", "text": "x"}], None, "missing column(s) prompt_id, prompt"),
        ([{"prompt_id": 1, "prompt": "x"}], None, "column prompt_id must be string, got int64"),
        ([{"prompt_id": "a", "prompt": "x", "seed": 1.5}], None, "column seed must be an integer type, got double"),
        ([{"prompt_id": "a", "prompt": "x"}, {"prompt_id": None, "prompt": "y"}], None, "1 null or empty prompt_id"),
        ([{"prompt_id": "a", "prompt": "x"}, {"prompt_id": " ", "prompt": "y"}], None, "1 null or empty prompt_id"),
    ],
)
def test_structural_problems_refused_up_front(tmp_path, rows, schema, needle):
    f = write_prompts(tmp_path / "p.parquet", rows, schema)
    with pytest.raises(PromptInputError) as e:
        open_prompts(str(f))
    assert needle in str(e.value)


def test_duplicate_ids_named_across_files(tmp_path):
    write_prompts(tmp_path / "in" / "a.parquet", simple_rows(3))
    write_prompts(tmp_path / "in" / "b.parquet", simple_rows(2, start=1) + [{"prompt_id": "z", "prompt": "q", "seed": 1}])
    with pytest.raises(PromptInputError) as e:
        open_prompts(str(tmp_path / "in"))
    msg = str(e.value)
    assert "2 duplicate prompt_id" in msg and "'p001' x2" in msg and "'p002' x2" in msg and "'z'" not in msg


def test_missing_input_and_empty_folder(tmp_path):
    with pytest.raises(PromptInputError, match="not found"):
        open_prompts(str(tmp_path / "nope.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(PromptInputError, match="no Parquet files"):
        open_prompts(str(tmp_path / "empty"))


def test_garbage_file_refused(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(PromptInputError, match="not a readable Parquet file"):
        open_prompts(str(tmp_path / "bad.parquet"))


@pytest.mark.parametrize(
    "prompt, seed, reason",
    [
        ("a cat", 0, None),
        ("a cat", None, None),
        ("a cat", MAX_SEED, None),
        (None, 1, "invalid prompt: null"),
        ("", 1, "invalid prompt: empty"),
        ("  \n", 1, "invalid prompt: empty"),
        ("x" * 101, 1, "invalid prompt: 101 characters, over the limit of 100"),
        ("a cat", -1, "invalid seed: -1"),
        ("a cat", 2**64 - 1, "invalid seed: 18446744073709551615"),
    ],
)
def test_row_problems(prompt, seed, reason):
    got = row_problem(prompt, seed, max_chars=100)
    assert got == reason if reason is None else got.startswith(reason)


def test_derived_seed_is_a_pure_function():
    assert derived_seed("p1", 0) == derived_seed("p1", 0)
    assert derived_seed("p1", 0) != derived_seed("p2", 0)
    assert derived_seed("p1", 0) != derived_seed("p1", 1)
    assert 0 <= derived_seed("p1", 7) < 2**31


def test_done_ids_and_selection(tmp_path):
    out = open_storage(str(tmp_path / "out"))
    assert done_ids(out) == set()
    ctx = RowContext(job_id="j", bundle="b", method="ar", config_hash="h")
    ok = failed_row(ctx, "p000", 0, "x") | {"status": "ok", "error": None}
    rows = [ok, failed_row(ctx, "p001", 1, "boom")]
    out.write_parquet("telemetry/run1_000.parquet", to_table(rows))
    (tmp_path / "out" / "telemetry" / "run2_000.parquet").write_bytes(b"truncated")  # a crashed write
    assert done_ids(out) == {"p000"}
    src = open_prompts(str(write_prompts(tmp_path / "p.parquet", simple_rows(4))))
    assert select_ids(src, None, {"p000"}) == (["p001", "p002", "p003"], 1)
    assert select_ids(src, 2, {"p000"}) == (["p001"], 1)
