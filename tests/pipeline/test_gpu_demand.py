"""GPU demand on a cluster whose GPU nodes autoscale from zero: the plan asks for GPUs,
waits a bounded, configurable time, then falls back (auto) or fails (cuda). Pure functions on
hand-written resource dicts and a fake clock, and the session's real local Ray for the
autoscaler request; no cluster is simulated here (tests/pipeline/test_multinode.py runs real nodes)."""

from __future__ import annotations

import json

import pytest

from pipeline.cluster import (DEFAULT_GPU_WAIT_S, ClusterUnavailable, GpuDemand, gpu_wait_s, plan_actors,
                              plan_gpu_demand, wait_for_gpus)
from pipeline.config import build_config


class Clock:
    """A fake clock for the wait's deadline (no sleeping in tests). Nodes joining and leaving
    for real are tests/pipeline/test_multinode.py: a GPU node joining a running job (the pool
    grows onto it), every GPU node lost (exit 3) and a resume on a node that joined."""

    def __init__(self):
        self.now = 0.0

    def sleep(self, s):
        self.now += s


def test_default_wait_depends_on_where_and_what():
    cuda, auto = build_config({"device": "cuda"}), build_config({})
    assert gpu_wait_s(cuda, "local") == 0 and gpu_wait_s(auto, "local") == 0  # no autoscaler in a local Ray
    assert gpu_wait_s(cuda, "10.0.0.1:6379") == DEFAULT_GPU_WAIT_S
    assert gpu_wait_s(auto, "10.0.0.1:6379") == 0  # unknown cluster: auto must not wait for GPUs that never come
    assert gpu_wait_s(auto, "10.0.0.1:6379", {"CPU": 64, "GPU": 8}) == DEFAULT_GPU_WAIT_S  # node types with GPUs
    assert gpu_wait_s(cuda, "10.0.0.1:6379", {"CPU": 64}) == 0
    assert gpu_wait_s(build_config({"gpu_wait_s": 42}), "local") == 42


def test_plan_creates_gpu_demand_on_a_cluster_without_gpus():
    cfg = build_config({"device": "cuda", "num_actors": 4, "gpu_wait_s": 300})
    demand = plan_gpu_demand(cfg, {"CPU": 8.0}, num_prompts=100, address="head:6379")
    assert demand == GpuDemand(actors=4, per_actor=1.0, wait_s=300)
    assert demand.bundles() == [{"GPU": 1.0}] * 4
    assert plan_gpu_demand(cfg, {"CPU": 8.0}, num_prompts=2, address="head:6379").actors == 2  # no idle actors
    assert plan_gpu_demand(cfg, {"CPU": 8.0, "GPU": 4.0}, 100, "head:6379") is None  # already there
    assert plan_gpu_demand(build_config({"device": "cpu"}), {"CPU": 8.0}, 100, "head:6379") is None


def test_a_pool_planned_on_fewer_gpus_than_asked_can_grow():
    plan = plan_actors(build_config({"device": "cuda", "num_actors": 4}), {"CPU": 8.0, "GPU": 2.0}, num_prompts=100,
                       can_grow=True)
    assert (plan.device, plan.num_actors, plan.pool_max) == ("cuda", 2, 4)  # ActorPoolStrategy(min_size=2, max_size=4)


def test_no_gpus_after_the_wait_falls_back_or_fails_clearly():
    clock, asked = Clock(), []
    res = wait_for_gpus(GpuDemand(2, 1.0, 60), lambda m: None, lambda: {"CPU": 8.0}, lambda bundles: asked.append(bundles),
                        clock=lambda: clock.now, sleep=clock.sleep)
    assert len(asked) > 1 and all(a == [{"GPU": 1.0}] * 2 for a in asked) and clock.now == 60  # sent at every poll
    auto = plan_actors(build_config({"num_actors": 2}), res, 10, can_grow=True, waited_s=60)
    assert auto.device == "cpu" and "after waiting 60 s" in auto.notes[0]
    with pytest.raises(ClusterUnavailable, match=r"after waiting 60 s for the autoscaler \(--gpu-wait-s\)"):
        plan_actors(build_config({"device": "cuda"}), res, 10, can_grow=True, waited_s=60)


def test_pool_watch_ends_the_job_once_no_node_can_host_an_actor_for_the_wait():
    """PoolWatch.check's rule on hand-written `ray.nodes()` entries and the fake clock; the job
    it ends when a real cluster loses its GPU nodes is test_multinode.py's exit-3 test."""
    from pipeline.cluster import ActorPlan, PoolWatch

    plan = ActorPlan("cuda", 2, 1.0, 1.0, 1)
    gpu = {"Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}}
    nodes, clock, woken = [gpu], Clock(), []
    watch = PoolWatch(plan, 30, lambda: woken.append(1), nodes_fn=lambda: nodes, clock=lambda: clock.now)
    assert watch.check(None) is None
    nodes[:] = [{"Alive": True, "Resources": {"CPU": 8.0}}, dict(gpu, Alive=False)]  # head only; the GPU node dead
    since = watch.check(None)
    clock.sleep(29)
    assert watch.check(since) == since and watch.lost is None
    nodes.append(gpu)  # one joined in time: the count starts again
    assert watch.check(since) is None
    nodes.pop()
    since = watch.check(None)
    clock.sleep(30)
    watch.check(since)
    assert "left the cluster and none joined within 30 s" in watch.lost and "1 GPU + 1 CPU" in watch.lost


@pytest.mark.slow
def test_real_local_ray_records_the_demand_with_a_custom_resource(ray_session):
    """A real Ray (the session's), `fake_gpu` standing in for GPUs: the autoscaler request
    lands in Ray's GCS, and is cleared after."""
    from gpu_demand_probe import probe

    got = json.loads(json.dumps(probe()))  # as the script would print it
    assert got["bundles"] == [{"fake_gpu": 1.0}, {"fake_gpu": 1.0}]
    assert got["recorded"] and "fake_gpu" in json.dumps(got["recorded"])  # the autoscaler sees the demand
    assert got["after"] == 0 and "0 of 2 fake_gpu joined" in got["notes"][-1]
    assert got["cleared"] == []  # the demand ends with the job
