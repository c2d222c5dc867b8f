"""Storage faults, each reproduced with real parts: the loopback S3 server, a cuttable TCP
proxy in front of it, closed ports, read-only folders, damaged Parquet files."""

import io
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import StorageSettings, build_config
from pipeline.driver import main_guarded
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_STORAGE_UNAVAILABLE
from pipeline.prompts import PromptInputError, open_prompts
from pipeline.retry import StorageUnavailable
from pipeline.storage import current_umask, image_key, open_storage, safe_name
from pipeline_helpers import simple_rows, write_prompts
from tcp_proxy import free_port

QUICK = {"retry_budget_s": 0.5, "timeout_s": 2.0}


def cfg_for(tmp_path, input, output, storage=None, **over):
    data = {"job_id": "f", "bundle": "random:0", "input": str(input), "output": str(output), "num_actors": 1,
            "decode": {"method": "ar", "temperature": 0.0}, "progress": False, "storage": storage or {}}
    data.update(over)
    return build_config(data)


def run_cli(cfg):
    out, err = io.StringIO(), io.StringIO()
    code = main_guarded(cfg, stream=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _one_line_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---- item 2: storage and network errors get exit code 4, one line naming URI and cause


def test_missing_output_bucket_exits_4(tmp_path, s3):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    code, _, err = run_cli(cfg_for(tmp_path, src, "s3://no-such-bucket-xyz/run", {"endpoint_url": s3.endpoint, **QUICK}))
    line = _one_line_error(err)
    assert code == EXIT_STORAGE_UNAVAILABLE
    assert "s3://no-such-bucket-xyz/run" in line and "NoSuchBucket" in line


@pytest.mark.parametrize("side", ["input", "output"])
def test_closed_port_endpoint_exits_4(tmp_path, aws_env, side):
    dead = f"http://127.0.0.1:{free_port()}"
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    if side == "input":
        cfg = cfg_for(tmp_path, "s3://bucket/prompts", tmp_path / "out", {"endpoint_url": dead, **QUICK})
    else:
        cfg = cfg_for(tmp_path, src, "s3://bucket/out", {"endpoint_url": dead, **QUICK})
    code, _, err = run_cli(cfg)
    line = _one_line_error(err)
    assert code == EXIT_STORAGE_UNAVAILABLE and "storage unavailable: s3://bucket/" in line
    assert "retry_budget_s=0.5" in line or "failed" in line
    assert not (tmp_path / "out").exists()


def test_unwritable_output_root_exits_4(tmp_path):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    ro = tmp_path / "ro"
    if os.geteuid() == 0:  # root ignores folder permissions: a file where a folder must go
        ro.write_text("a file")
        cause = "NotADirectoryError"
    else:
        ro.mkdir()
        ro.chmod(0o555)
        cause = "PermissionError"
    try:
        code, _, err = run_cli(cfg_for(tmp_path, src, ro / "out"))
    finally:
        ro.chmod(0o755)
    line = _one_line_error(err)
    assert code == EXIT_STORAGE_UNAVAILABLE and str(ro / "out") in line and cause in line


def _corrupt_column(path, column: int) -> None:
    """Overwrite the pages of one column chunk with junk (the footer stays intact)."""
    meta = pq.ParquetFile(path).metadata.row_group(0).column(column)
    start = meta.dictionary_page_offset or meta.data_page_offset
    data = bytearray(path.read_bytes())
    data[start:start + meta.total_compressed_size] = b"\xff" * meta.total_compressed_size
    path.write_bytes(bytes(data))


def _prompts_file(tmp_path):
    rows = [{"prompt_id": f"id{i:04d}", "prompt": f"prompt number {i} " * 3, "seed": i} for i in range(300)]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy")
    return path


@pytest.mark.parametrize("column, name", [(0, "prompt_id"), (1, "prompt")])  # item 2 (ids), item 3 (prompts)
def test_corrupt_pages_refused_before_any_work(tmp_path, column, name):
    path = _prompts_file(tmp_path)
    _corrupt_column(path, column)
    with pytest.raises(PromptInputError, match="not a readable Parquet file"):
        open_prompts(str(path))
    code, _, err = run_cli(cfg_for(tmp_path, path, tmp_path / "out"))
    assert code == EXIT_BAD_INPUT and str(path) in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing written, Ray never started


# ---- item 4: a blip is ridden out, a permanent outage ends in bounded time


def test_blip_shorter_than_the_budget_is_ridden_out(proxy, s3):
    store = open_storage(f"s3://{s3.bucket}/blip", StorageSettings(endpoint_url=proxy.endpoint, retry_budget_s=30,
                                                                    timeout_s=2))
    store.put_text("before.txt", "1")
    proxy.cut()
    restorer = threading.Thread(target=lambda: (proxy.wait_refused(3), proxy.restore()))
    restorer.start()
    store.put_text("during.txt", "2")  # fails at least 3 times, then the proxy is back
    restorer.join()
    assert proxy.refused >= 3 and store.get_text("during.txt") == "2"


def test_permanent_outage_ends_as_storage_unavailable(proxy, s3):
    store = open_storage(f"s3://{s3.bucket}/gone", StorageSettings(endpoint_url=proxy.endpoint, **QUICK))
    store.put_text("a.txt", "1")
    proxy.cut()
    for op in (lambda: store.put_text("b.txt", "2"), lambda: store.list_keys("telemetry"), lambda: store.get_text("a.txt")):
        with pytest.raises(StorageUnavailable) as e:
            op()
        assert f"s3://{s3.bucket}/gone" in str(e.value) and "retry_budget_s=0.5" in str(e.value)
    assert proxy.refused >= 3


def test_missing_key_is_not_an_outage(s3):
    store = open_storage(f"s3://{s3.bucket}/k", StorageSettings(endpoint_url=s3.endpoint, **QUICK))
    with pytest.raises(FileNotFoundError):
        store.get_bytes("nope")


# ---- item 11: files get the mode the umask says


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_local_files_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        store = open_storage(str(tmp_path / "out"))
        store.put_bytes("images/a.png", b"x")
        store.write_parquet("telemetry/t.parquet", pa.table({"x": [1]}))
        assert store.create("lease.json", b"{}")
    finally:
        os.umask(old)
    for rel in ("images/a.png", "telemetry/t.parquet", "lease.json"):
        assert (tmp_path / "out" / rel).stat().st_mode & 0o777 == mode, rel


# ---- item 12: ids that differ only by case get distinct keys; zero rows is refused


def test_case_only_different_ids_do_not_collide():
    names = {safe_name(i).lower() for i in ["A", "a", "Ab", "aB", "ab"]}
    assert len(names) == 5
    assert safe_name("p001") == "p001" and image_key("a") == "images/a.png"
    assert safe_name("A").startswith("A-")


def test_zero_row_input_is_refused(tmp_path):
    empty = write_prompts(tmp_path / "e.parquet", [], schema=pa.schema([("prompt_id", pa.string()), ("prompt", pa.string())]))
    with pytest.raises(PromptInputError, match=r"no prompts \(0 rows\)"):
        open_prompts(str(empty))
    code, _, err = run_cli(cfg_for(tmp_path, empty, tmp_path / "out"))
    assert code == EXIT_BAD_INPUT and "no prompts" in err


def test_output_folder_that_cannot_be_made_is_unavailable_not_missing():
    """--output /proc/x: mkdir's ENOENT is an unwritable output (exit 4), not a missing key."""
    with pytest.raises(StorageUnavailable, match="cannot create folder"):
        open_storage("/proc/x").put_bytes("images/a.png", b"1")
