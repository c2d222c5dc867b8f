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
