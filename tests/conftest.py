"""Fixtures shared by every test package."""

import pytest


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real S3-compatible HTTP server on 127.0.0.1 (random port), for the session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()
