"""The session's in-process Ray and the dummy AWS credentials (a plain module: conftest.py and
tests that restart the session's Ray import it)."""

import uuid

DUMMY_AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # skip the 5 s instance-metadata probe
}


def init_session_ray():
    """The in-process Ray the session's tests share (also restarted after a module that ran a
    multi-node cluster instead: tests/pipeline/test_multinode.py). num_cpus is declared above
    the 2 real cores so actors plus read/write tasks always fit (see ray_notes: the 2-core
    deadlock). Its workers get the dummy AWS credentials."""
    import ray

    ray.init(
        address="local",  # a new Ray, never one someone started with `ray start` on this host
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
