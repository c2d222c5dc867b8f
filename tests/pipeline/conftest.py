"""Shared fixtures for the pipeline tests: a loopback S3 server (moto), a bucket per test,
prompt files, and one in-process Ray for the whole session."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest

DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # skip the 5 s instance-metadata probe
}


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy credentials and no stray AWS settings from the host."""
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    for k, v in DUMMY_AWS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def s3(moto_endpoint, aws_env):
    """A fresh bucket on the loopback server: .endpoint, .bucket, .client (boto3)."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = "test-" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=bucket)
    return SimpleNamespace(endpoint=moto_endpoint, bucket=bucket, client=client)


@pytest.fixture(scope="session")
def ray_session():
    """One in-process Ray for every Ray test in the session (ray.init costs seconds and
    ~0.6 GB). num_cpus is declared above the 2 real cores so actors plus read/write tasks
    always fit (see ray_notes: the 2-core deadlock)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    env = dict(DUMMY_AWS)
    ray.init(
        num_cpus=4,
        num_gpus=0,
        object_store_memory=256 * 1024**2,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": env},
        namespace="pipeline-tests-" + uuid.uuid4().hex[:6],
        # Ray starts workers at niceness 15; on a machine shared with other work that starves
        # the actors. Run them at normal priority, like the test process itself.
        _system_config={"worker_niceness": 0},
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def proxy(moto_endpoint):
    """A cuttable TCP proxy in front of the loopback S3 server (.endpoint, .cut(), .restore())."""
    from tcp_proxy import TcpProxy

    p = TcpProxy(moto_endpoint)
    try:
        yield p
    finally:
        p.close()
