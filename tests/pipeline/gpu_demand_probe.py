"""On a real Ray with no "fake_gpu" (the custom resource standing in for GPUs): the driver's
GPU wait asks the autoscaler for two actors' worth through the real `request_resources`, the
demand is read back from Ray's GCS, the wait ends at its (short) deadline because no node
joins, and the demand is cleared. test_gpu_demand.py runs `probe()` on the session's
in-process Ray; run as a script, it starts a local Ray of its own (loopback only) and prints
one JSON line."""

import json
import sys

import ray
from ray.autoscaler.sdk import request_resources

from pipeline.cluster import plan_gpu_demand, wait_for_gpus
from pipeline.config import build_config


def recorded_demand() -> list:
    """The resource request the autoscaler reads (v1: a KV entry; v2: cluster constraints)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2():
        from ray.autoscaler.v2.sdk import get_cluster_resource_constraints

        return [str(c) for c in get_cluster_resource_constraints(ray.get_runtime_context().gcs_address)]
    from ray._private.ray_constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)
    return json.loads(raw) if raw else []


def probe() -> dict:
    """The demand as the connected Ray's GCS records it, and after the wait clears it."""
    out = {}
    cfg = build_config({"device": "cuda", "num_actors": 2, "gpu_wait_s": 1})
    demand = plan_gpu_demand(cfg, ray.cluster_resources(), 10, "127.0.0.1:6379", None, resource="fake_gpu")

    def request(bundles):
        # One request slot for the whole cluster: Ray Data's autoscaling coordinator (a detached
        # actor on a Ray that ran a Dataset, as the session's has) writes its merged requests
        # there on its own clock (so wait_for_gpus sends it at every poll). Read back right after
        # the first sends; sent again if overwritten in between.
        for _ in range(3):
            request_resources(bundles=bundles)
            if out.get("recorded"):
                break
            out["recorded"] = recorded_demand()
            if out["recorded"]:
                break

    notes = []
    try:
        after = wait_for_gpus(demand, notes.append, ray.cluster_resources, request, poll_s=0.2)
    finally:
        request_resources(bundles=[])
    out.update(after=after.get("fake_gpu", 0), bundles=demand.bundles(), notes=notes, cleared=recorded_demand())
    return out


def main(temp_dir: str) -> None:
    ray.init(address="local", num_cpus=1, include_dashboard=False, object_store_memory=80 * 1024**2,
             _temp_dir=temp_dir, _node_ip_address="127.0.0.1")
    try:
        out = probe()
    finally:
        ray.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
