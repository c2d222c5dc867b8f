"""GPU demand on a cluster whose GPU nodes autoscale from zero: the plan asks for GPUs,
waits a bounded, configurable time, then falls back (auto) or fails (cuda)."""

from __future__ import annotations

import pytest

from pipeline.cluster import (DEFAULT_GPU_WAIT_S, ClusterUnavailable, GpuDemand, gpu_wait_s, plan_actors,
                              plan_gpu_demand, wait_for_gpus)
from pipeline.config import build_config


class Clock:
    """A fake clock for the wait's deadline (no sleeping in tests); the GPU node joining for
    real is tests/pipeline/test_multinode.py (a Cluster node added while the driver waits)."""

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
    assert asked == [[{"GPU": 1.0}] * 2] and clock.now == 60
    auto = plan_actors(build_config({"num_actors": 2}), res, 10, can_grow=True, waited_s=60)
    assert auto.device == "cpu" and "after waiting 60 s" in auto.notes[0]
    with pytest.raises(ClusterUnavailable, match=r"after waiting 60 s for the autoscaler \(--gpu-wait-s\)"):
        plan_actors(build_config({"device": "cuda"}), res, 10, can_grow=True, waited_s=60)
