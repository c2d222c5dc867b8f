"""GPU demand on a cluster whose GPU nodes autoscale from zero: the plan asks for GPUs,
waits a bounded, configurable time, then falls back (auto) or fails (cuda)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.cluster import (DEFAULT_GPU_WAIT_S, ClusterUnavailable, GpuDemand, gpu_wait_s, plan_actors,
                              plan_gpu_demand, wait_for_gpus)
from pipeline.config import build_config

REPO = Path(__file__).resolve().parents[2]


class FakeCluster:
    """cluster_resources() that gains GPUs once `join_after` seconds of fake time passed."""

    def __init__(self, join_after: float, gpus: float = 4.0):
        self.now, self.join_after, self.gpus, self.requests = 0.0, join_after, gpus, []

    def resources(self):
        return {"CPU": 8.0, **({"GPU": self.gpus} if self.now >= self.join_after else {})}

    def request(self, bundles):
        self.requests.append(bundles)

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


def test_wait_returns_when_gpus_join_and_the_pool_can_grow():
    fake = FakeCluster(join_after=42.0, gpus=2.0)
    notes = []
    demand = GpuDemand(actors=4, per_actor=1.0, wait_s=120)
    res = wait_for_gpus(demand, notes.append, fake.resources, fake.request, clock=lambda: fake.now, sleep=fake.sleep)
    assert fake.requests == [[{"GPU": 1.0}] * 4] and res["GPU"] == 2.0 and fake.now == 120
    plan = plan_actors(build_config({"device": "cuda", "num_actors": 4}), res, num_prompts=100, can_grow=True)
    assert (plan.device, plan.num_actors, plan.pool_max) == ("cuda", 2, 4)  # ActorPoolStrategy(min_size=2, max_size=4)
    fake = FakeCluster(join_after=30.0, gpus=4.0)
    res = wait_for_gpus(demand, notes.append, fake.resources, fake.request, clock=lambda: fake.now, sleep=fake.sleep)
    assert res["GPU"] == 4.0 and fake.now < 40  # returns as soon as every actor's GPUs are there


def test_no_gpus_after_the_wait_falls_back_or_fails_clearly():
    fake = FakeCluster(join_after=1e9)
    res = wait_for_gpus(GpuDemand(2, 1.0, 60), lambda m: None, fake.resources, fake.request,
                        clock=lambda: fake.now, sleep=fake.sleep)
    auto = plan_actors(build_config({"num_actors": 2}), res, 10, can_grow=True, waited_s=60)
    assert auto.device == "cpu" and "after waiting 60 s" in auto.notes[0]
    with pytest.raises(ClusterUnavailable, match=r"after waiting 60 s for the autoscaler \(--gpu-wait-s\)"):
        plan_actors(build_config({"device": "cuda"}), res, 10, can_grow=True, waited_s=60)


@pytest.mark.slow
def test_real_local_ray_records_the_demand_with_a_custom_resource(tmp_path):
    """A real Ray, `fake_gpu` standing in for GPUs: the autoscaler request lands in Ray's GCS."""
    temp_dir = tempfile.mkdtemp(prefix="rgd", dir="/tmp")  # short: socket paths have a length limit
    env = dict(os.environ, PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("gpu_demand_probe.py")), temp_dir],
                              env=env, capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["bundles"] == [{"fake_gpu": 1.0}, {"fake_gpu": 1.0}]
    assert got["recorded"] and "fake_gpu" in json.dumps(got["recorded"])  # the autoscaler sees the demand
    assert got["after"] == 0 and "0 of 2 fake_gpu joined" in got["notes"][-1]
    assert got["cleared"] == []  # the demand ends with the job
