"""Fixtures shared by every test package: a loopback S3 server (moto), dummy AWS credentials,
and one in-process Ray for the whole session (the jobs and pipeline tests share it)."""

import uuid

import pytest

DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # skip the 5 s instance-metadata probe
}


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
    on one core, and ~0.6 GB). Its workers get the dummy AWS credentials. num_cpus is
    declared above the 2 real cores so actors plus read/write tasks always fit (see
    ray_notes: the 2-core deadlock)."""
    import ray

    if ray.is_initialized():
        yield ray
        return
    ray.init(
        # "local": always a new instance, never a cluster another process left in
        # /tmp/ray/ray_current_cluster (a multi-node test's head, a `ray start`)
        address="local",
        num_cpus=4,
        num_gpus=0,
        object_store_memory=256 * 1024**2,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={"env_vars": dict(DUMMY_AWS)},
        namespace="tests-" + uuid.uuid4().hex[:6],
        # Ray starts workers at niceness 15; on a machine shared with other work that starves
        # the actors. Run them at normal priority, like the test process itself.
        _system_config={"worker_niceness": 0},
    )
    try:
        yield ray
    finally:
        ray.shutdown()
