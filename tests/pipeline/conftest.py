"""Shared fixtures for the pipeline tests: a bucket per test on the loopback S3 server and a
cuttable proxy in front of it (the server, dummy credentials and the session's in-process Ray:
tests/conftest.py)."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

import pytest


@pytest.fixture
def s3(moto_endpoint, aws_env):
    """A fresh bucket on the loopback server: .endpoint, .bucket, .client (boto3)."""
    import boto3

    client = boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1")
    bucket = "test-" + uuid.uuid4().hex[:12]
    client.create_bucket(Bucket=bucket)
    return SimpleNamespace(endpoint=moto_endpoint, bucket=bucket, client=client)


@pytest.fixture
def proxy(moto_endpoint):
    """A cuttable TCP proxy in front of the loopback S3 server (.endpoint, .cut(), .restore())."""
    from tcp_proxy import TcpProxy

    p = TcpProxy(moto_endpoint)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(autouse=True)
def bounded_actor_wait(request, monkeypatch):
    """On the session's Ray, a pool whose actors cannot be placed fails in 120 s instead of
    Ray Data's 30 min (pipeline.execute's default): a job that leaves its actors holding the
    CPUs makes the next test's job fail, not hang the suite."""
    if "ray_session" in request.fixturenames:
        from ray.data import DataContext

        monkeypatch.setattr(DataContext.get_current(), "wait_for_min_actors_s", 120)
