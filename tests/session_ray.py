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
    deadlock). Its workers get the dummy AWS credentials through the environment the raylet
    starts with (this process's, with DUMMY_AWS set only while Ray starts), not a runtime_env:
    a job with a runtime_env gets no pre-started workers, so every actor (two per job in most
    tests) would wait for a new worker process of its own (~2 s more per actor, more on a loaded
    machine)."""
    import os

    import ray

    saved = {k: os.environ.get(k) for k in DUMMY_AWS}
    os.environ.update(DUMMY_AWS)
    try:
        _init(ray)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init(ray) -> None:
    ray.init(
        address="local",  # a new Ray, never one someone started with `ray start` on this host
        num_cpus=4,
        num_gpus=0,
        object_store_memory=256 * 1024**2,
        include_dashboard=False,
        log_to_driver=True,
        namespace="tests-" + uuid.uuid4().hex[:6],
        # Ray starts workers at niceness 15; on a machine shared with other work that starves
        # the actors. Run them at normal priority, like the test process itself.
        _system_config={"worker_niceness": 0},
    )
