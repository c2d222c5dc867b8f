import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import StorageSettings
from pipeline.storage import check_key, image_key, open_storage, parse_uri, safe_name


@pytest.mark.parametrize(
    "pid",
    ["p001", "a/b", "../../etc/passwd", "..", ".", ".hidden", "", "x" * 500, "ümlaut ✓", "a\\b", "C:\\win", "a\x00b"],
)
def test_safe_name_is_one_plain_segment(pid):
    name = safe_name(pid)
    assert name and "/" not in name and "\\" not in name and not name.startswith(".")
    assert len(name) <= 140
    check_key(image_key(pid))


def test_safe_name_keeps_plain_ids_and_separates_lookalikes():
    assert safe_name("p-001_x.v2") == "p-001_x.v2"
    assert len({safe_name(p) for p in ["a/b", "a_b", "a:b", "a b", "A/b"]}) == 5


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "./a", "a/.", "..", "a\\b"])
def test_bad_keys_refused(key):
    with pytest.raises(ValueError):
        check_key(key)


def test_parse_uri(tmp_path):
    assert parse_uri("s3://bucket/some/prefix/").path == "some/prefix"
    assert parse_uri("s3://bucket").uri == "s3://bucket"
    assert parse_uri(str(tmp_path)).uri == f"file://{tmp_path}"
    assert parse_uri(f"file://{tmp_path}/x").path == f"{tmp_path}/x"
    with pytest.raises(ValueError):
        parse_uri("gs://bucket/x")


def _exercise(store):
    assert store.list_keys() == []
    uri = store.put_bytes("images/a.png", b"\x89PNG", "image/png")
    assert uri == store.uri + "/images/a.png"
    store.put_text("images/ab.png", "x")
    store.put_text("job.json", "{}")
    assert store.get_bytes("images/a.png") == b"\x89PNG"
    assert store.exists("images/a.png") and not store.exists("images/zz.png")
    assert store.list_keys() == ["images/a.png", "images/ab.png", "job.json"]
    assert store.list_keys("images") == ["images/a.png", "images/ab.png"]
    assert store.list_keys("images/a.png") == ["images/a.png"]
    store.put_bytes("images/a.png", b"new")  # overwrite is allowed (deterministic keys)
    assert store.get_bytes("images/a.png") == b"new"
    with pytest.raises(FileNotFoundError):
        store.get_bytes("nope")
    with pytest.raises(ValueError):
        store.put_bytes("../escape", b"")
    # Parquet through the pyarrow filesystem of the same store
    store.write_parquet("t/part.parquet", pa.table({"x": [1, 2]}))
    assert pq.read_table(store.arrow_path("t"), filesystem=store.arrow_fs())["x"].to_pylist() == [1, 2]
    assert store.read_parquet("t/part.parquet", columns=["x"]).num_rows == 2
    assert "t/part.parquet" in store.list_keys("t")


def test_local_storage(tmp_path):
    store = open_storage(str(tmp_path / "out"))
    _exercise(store)
    assert not list((tmp_path / "out" / "images").glob(".tmp-*"))


def test_s3_storage_against_loopback_server(s3, caplog):
    caplog.set_level(logging.DEBUG)
    store = open_storage(f"s3://{s3.bucket}/jobs/j1", StorageSettings(endpoint_url=s3.endpoint))
    _exercise(store)
    keys = [o["Key"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]]
    assert "jobs/j1/images/a.png" in keys and all(k.startswith("jobs/j1/") for k in keys)
    # credentials never show up in reprs or logs
    assert "testing" not in repr(store) and s3.endpoint in repr(store)
    assert "AWS_SECRET" not in caplog.text and "secret_key" not in caplog.text.lower()


def test_s3_endpoint_from_standard_env(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    store = open_storage(f"s3://{s3.bucket}/viaenv")
    store.put_text("k.txt", "v")
    assert s3.client.get_object(Bucket=s3.bucket, Key="viaenv/k.txt")["Body"].read() == b"v"
    pq.write_table(pa.table({"y": [3]}), store.arrow_path("p.parquet"), filesystem=store.arrow_fs())
    assert store.exists("p.parquet")


def test_s3_storage_pickles_without_client(s3):
    import pickle

    store = open_storage(f"s3://{s3.bucket}/pk", StorageSettings(endpoint_url=s3.endpoint))
    store.put_text("a", "1")
    again = pickle.loads(pickle.dumps(store))
    assert again.get_text("a") == "1"
