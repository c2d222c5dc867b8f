"""Fixtures shared by every test package: a loopback S3 server (moto), dummy AWS credentials,
and one in-process Ray for the whole session (the jobs and pipeline tests share it)."""

import pytest

from session_ray import DUMMY_AWS, init_session_ray  # noqa: F401 - DUMMY_AWS: aws_env



@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3-compatible HTTP server on 127.0.0.1 (random port), for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    """Dummy credentials and no stray AWS settings from the host."""
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials")
    for k, v in DUMMY_AWS.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="session")
def ray_session():
    """One in-process Ray for every Ray test in the session (ray.init and shutdown cost ~10 s
    on one core, and ~0.6 GB): `init_session_ray`."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    init_session_ray()
    try:
        yield ray
    finally:
        ray.shutdown()
