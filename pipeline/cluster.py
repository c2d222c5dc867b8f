"""The Ray side of the driver: which cluster to join, reaching it in bounded time, and how
the actor pool is placed on it.

- `ray_target`: `ray_address` or RAY_ADDRESS, else "local": a new in-process Ray, never a
  cluster someone started with `ray start` on this machine unless asked for ("auto").
- `connect`: host:port targets are probed with a TCP connect first (`ray_connect_timeout_s`)
  and ray.init runs under the same deadline (an alarm), so a wrong address fails in seconds
  with exit code 3 instead of hanging.
- `plan_gpu_demand` / `wait_for_gpus`: a cluster whose GPU nodes start at zero (the launcher's
  `min_workers: 0`, KubeRay `minReplicas: 0`) has no GPUs when the job starts, and nothing
  asks for one until an actor does. When the job wants GPU actors the cluster does not have
  yet, the driver asks the autoscaler for them (`ray.autoscaler.sdk.request_resources`,
  one bundle per actor) and waits up to `gpu_wait_s` for them to join; only then does
  `device: auto` fall back to CPU actors or `device: cuda` fail (exit 3).
- `PoolWatch`: while the pool runs, a thread asks Ray every few seconds whether a live node
  can still host an actor of the plan; when none can for `node_lost_wait_s` (every GPU node
  preempted, none joining), it ends the job (exit 3) instead of letting Ray Data wait
  forever for actors to restart.
- `plan_actors`: GPUs or CPU shares per actor, capped to what the cluster and the number of
  prompts can use; a CPU share never below MIN_CPUS_PER_ACTOR. On a cluster that can grow,
  a GPU pool is autoscaling: it starts with the actors that fit and grows to the number
  asked for as GPU nodes join (`ActorPoolStrategy(min_size, max_size)`).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

from pipeline.config import MIN_CPUS_PER_ACTOR, JobConfig

LOCAL_OBJECT_STORE_BYTES = 1024**3
DEFAULT_GPU_WAIT_S = 600.0  # on a cluster: a cold GPU node (instance + image pull + ray start) takes minutes
GPU_POLL_S = 5.0


class ClusterUnavailable(Exception):
    """The Ray cluster cannot be reached or cannot host the actors (exit code 3)."""


@dataclass
class ActorPlan:
    """How the actor pool is placed on the cluster."""

    device: str  # "cuda" | "cpu"
    num_actors: int
    num_gpus: float  # per actor
    num_cpus: float  # per actor
    threads: int  # torch intra-op threads per actor
    notes: list[str] = field(default_factory=list)
    max_actors: int = 0  # the pool may grow to this as GPU nodes join (0: num_actors, a fixed pool)

    @property
    def pool_max(self) -> int:
        return max(self.num_actors, self.max_actors)


@dataclass(frozen=True)
class GpuDemand:
    """GPUs the job asks the autoscaler for, and how long it waits for them."""

    actors: int
    per_actor: float
    wait_s: float
    resource: str = "GPU"  # tests stand a custom resource in for GPUs

    @property
    def needed(self) -> float:
        return self.actors * self.per_actor

    def bundles(self) -> list[dict[str, float]]:
        return [{self.resource: self.per_actor} for _ in range(self.actors)]


def gpu_wait_s(cfg: JobConfig, address: str, max_resources: Optional[dict[str, float]] = None,
               resource: str = "GPU") -> float:
    """cfg.gpu_wait_s when set. Else: 0 on a new local Ray (no autoscaler); on a cluster whose
    autoscaler reported its node types (`max_resources`), DEFAULT_GPU_WAIT_S when they can
    add GPUs and 0 when none can; on a cluster without that report, DEFAULT_GPU_WAIT_S for
    device cuda and 0 for auto (a CPU cluster must not wait for GPUs that never come)."""
    if cfg.gpu_wait_s is not None:
        return cfg.gpu_wait_s
    if address == "local":
        return 0.0
    if max_resources is not None:
        return DEFAULT_GPU_WAIT_S if float(max_resources.get(resource, 0) or 0) > 0 else 0.0
    return DEFAULT_GPU_WAIT_S if cfg.device == "cuda" else 0.0


def plan_gpu_demand(cfg: JobConfig, resources: dict[str, float], num_prompts: Optional[int], address: str,
                    max_resources: Optional[dict[str, float]] = None, resource: str = "GPU") -> Optional[GpuDemand]:
    """The GPUs to ask for before planning the pool; None when the job runs on CPUs, the
    GPUs are already there, or it must not wait (gpu_wait_s 0)."""
    if cfg.device == "cpu":
        return None
    n = cfg.num_actors if not num_prompts else min(cfg.num_actors, num_prompts)
    if float(resources.get(resource, 0.0)) >= n * cfg.gpus_per_actor:
        return None
    wait = gpu_wait_s(cfg, address, max_resources, resource)
    return GpuDemand(n, cfg.gpus_per_actor, wait, resource) if wait > 0 else None


def autoscaler_max_resources() -> Optional[dict[str, float]]:
    """What the autoscaler said the cluster can grow to (per resource), or None when no
    autoscaler reported its node types (a local Ray, a cluster started by hand)."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config()
    except Exception:  # noqa: BLE001 - a private API: treat any failure as "not reported"
        return None


def wait_for_gpus(demand: GpuDemand, say: Callable[[str], None], resources_fn: Callable[[], dict[str, float]],
                  request_fn: Callable[..., None], clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep, poll_s: float = GPU_POLL_S) -> dict[str, float]:
    """Ask for `demand` (request_fn(bundles=...), i.e. request_resources) and poll the
    cluster until every actor's GPUs are there or `demand.wait_s` passed; returns the
    resources seen last (the pool then takes what fits, and grows as more nodes join). The
    request is sent again at every poll: the cluster keeps one request slot, and Ray Data's
    autoscaling coordinator (once a Dataset ran) overwrites it with its own on its own clock."""
    say(f"asking the autoscaler for {demand.actors} x {demand.per_actor:g} {demand.resource}; "
        f"waiting up to {demand.wait_s:g} s (gpu_wait_s) for them to join")
    start = clock()
    deadline = start + demand.wait_s
    while True:
        request_fn(bundles=demand.bundles())
        res = resources_fn()
        have = float(res.get(demand.resource, 0.0))
        if have >= demand.needed:
            say(f"{have:g} {demand.resource} in the cluster after {clock() - start:.0f} s")
            return res
        now = clock()
        if now >= deadline:
            say(f"waited {demand.wait_s:g} s: {have:g} of {demand.needed:g} {demand.resource} joined")
            return res
        sleep(max(0.0, min(poll_s, deadline - now)))


def plan_actors(cfg: JobConfig, resources: dict[str, float], num_prompts: Optional[int] = None,
                can_grow: bool = False, waited_s: float = 0.0) -> ActorPlan:
    """Decide GPUs/CPUs per actor from the cluster's resources, so the pool can always be
    scheduled, read/write tasks keep a CPU (the 2-core deadlock in ray_notes), no actor gets
    less than MIN_CPUS_PER_ACTOR, and no actor is started without a prompt to work on."""
    gpus = float(resources.get("GPU", 0.0))
    cpus = float(resources.get("CPU", 0.0))
    n = cfg.num_actors
    notes: list[str] = []
    if cfg.device == "cuda" and gpus < cfg.gpus_per_actor:
        waited = (f" after waiting {waited_s:g} s for the autoscaler (--gpu-wait-s)" if waited_s
                  else " (--gpu-wait-s waits for an autoscaler to add GPU nodes)")
        raise ClusterUnavailable(f"device 'cuda' requested but the cluster has {gpus:g} GPU(s){waited} "
                                 f"(need {cfg.gpus_per_actor:g} per actor); use --device auto or cpu")
    if cpus <= 0:
        raise ClusterUnavailable("the Ray cluster reports no CPUs")
    if num_prompts is not None and 0 < num_prompts < n:
        notes.append(f"{n} actors requested for {num_prompts} prompt(s): running {num_prompts}")
        n = num_prompts
    if cfg.device != "cpu" and gpus >= cfg.gpus_per_actor:
        fit = int(gpus // cfg.gpus_per_actor)
        grow_to = 0
        if fit < n:
            if can_grow:
                notes.append(f"{n} actors requested, {gpus:g} GPUs fit {fit} now: the pool grows as GPU nodes join")
                grow_to = n
            else:
                notes.append(f"{n} actors requested but {gpus:g} GPUs fit {fit}: running {fit}")
            n = fit
        per_cpu = min(1.0, max(0.1, (cpus - 1.0) / n)) if cpus > 1 else cpus / (2 * n)
        return ActorPlan("cuda", n, cfg.gpus_per_actor, per_cpu, 1, notes, max_actors=grow_to)
    spare = 1.0 if cpus >= 2 else cpus / 2  # left for read, repartition and write tasks
    budget = cpus - spare
    if cfg.cpus_per_actor is not None:
        per_cpu = cfg.cpus_per_actor
        fit = int(budget // per_cpu + 1e-9)
        if fit < 1:
            raise ClusterUnavailable(
                f"an actor of {per_cpu:g} CPUs leaves no CPU for the read/write tasks on a cluster with "
                f"{cpus:g} CPUs (the job would hang): lower cpus_per_actor")
    else:
        fit = max(1, int(budget // MIN_CPUS_PER_ACTOR + 1e-9))
        per_cpu = None
    if fit < n:
        share = per_cpu if per_cpu is not None else MIN_CPUS_PER_ACTOR
        notes.append(f"{n} actors requested but {budget:g} CPU(s) for actors fit {fit} at {share:g} CPU each: running {fit}")
        n = fit
    if per_cpu is None:
        per_cpu = budget / n
    # torch threads: every core of the cluster shared among the actors (Ray's CPU reservation
    # stays fractional, so the read/write tasks can still be scheduled)
    threads = max(1, int(cpus // n))
    if cfg.device == "auto":
        waited = f" after waiting {waited_s:g} s for the autoscaler" if waited_s else ""
        notes.insert(0, f"no GPUs in the cluster{waited}: running {n} CPU actor(s)")
    return ActorPlan("cpu", n, 0.0, round(per_cpu, 4), threads, notes)


def can_host(node: dict, plan: ActorPlan) -> bool:
    """A live node (ray.nodes() entry) with the resources of one actor of `plan`."""
    res = node.get("Resources") or {}
    return bool(node.get("Alive")) and float(res.get("CPU", 0.0)) >= plan.num_cpus - 1e-9 \
        and float(res.get("GPU", 0.0)) >= plan.num_gpus - 1e-9


class PoolWatch:
    """Ends the job when no live node can host an actor of `plan` for `wait_s` seconds: sets
    `lost` (the one line the job ends with) and interrupts the main thread, which is blocked in
    Ray Data waiting for actors that cannot restart anywhere (`interrupt`: the driver's
    `_Signals.interrupt`, a real SIGINT sent to the main thread)."""

    def __init__(self, plan: ActorPlan, wait_s: float, interrupt: Callable[[], None], poll_s: float = 1.0,
                 nodes_fn: Optional[Callable[[], list[dict]]] = None, clock: Callable[[], float] = time.monotonic):
        self.plan, self.wait_s, self.interrupt, self.poll_s, self.clock = plan, wait_s, interrupt, poll_s, clock
        self.nodes_fn = nodes_fn
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-watch", daemon=True)

    def __enter__(self) -> "PoolWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def check(self, since: Optional[float]) -> Optional[float]:
        """One look at the cluster: the moment hosting nodes were first seen missing (None
        while one is there); sets `lost` once they were missing for wait_s."""
        import ray

        nodes = self.nodes_fn() if self.nodes_fn else ray.nodes()
        if any(can_host(n, self.plan) for n in nodes):
            return None
        now = self.clock()
        since = now if since is None else since
        if now - since >= self.wait_s:
            need = f"{self.plan.num_gpus:g} GPU + {self.plan.num_cpus:g} CPU" if self.plan.num_gpus \
                else f"{self.plan.num_cpus:g} CPU"
            self.lost = (f"every node that could host an actor ({need}) left the cluster and none joined within "
                         f"{self.wait_s:g} s (--node-lost-wait-s); the rows done are kept: rerun with --resume")
        return since

    def _run(self) -> None:
        since = None
        while not self._stop.wait(self.poll_s):
            try:
                since = self.check(since)
            except Exception:  # noqa: BLE001 - the GCS busy or gone: look again
                continue
            if self.lost:
                self.interrupt()  # the driver's SIGINT handler raises JobInterrupted in its main thread
                return


def actor_restarts(actor_ids: list[str]) -> int:
    """How many times Ray restarted these actors (GCS actor table; 0 when it cannot say)."""
    try:
        from ray._private import state

        return sum(int(state.actors(actor_id=a).get("NumRestarts", 0) or 0)
                   for a in set(actor_ids) if a and a not in ("local", "driver"))
    except Exception:  # noqa: BLE001 - a private API: the count is informative only
        return 0


# ----------------------------------------------------------------------------------------
# Connecting


def ray_target(cfg: JobConfig, env: Optional[dict[str, str]] = None) -> str:
    """The address ray.init gets: the config's, else RAY_ADDRESS, else "local"."""
    env = os.environ if env is None else env
    return cfg.ray_address or env.get("RAY_ADDRESS") or "local"


def _host_port(address: str) -> Optional[tuple[str, int]]:
    """(host, port) of a host:port, ray:// or http(s):// address; None for local/auto."""
    if address in ("local", "auto"):
        return None
    u = urlparse(address if "://" in address else f"tcp://{address}")
    if u.hostname and u.port:
        return u.hostname, u.port
    return None


def probe(address: str, timeout_s: float) -> None:
    """Fail fast when nothing listens at the address (ClusterUnavailable naming it)."""
    hp = _host_port(address)
    if hp is None:
        return
    try:
        with socket.create_connection(hp, timeout=timeout_s):
            pass
    except OSError as e:
        raise ClusterUnavailable(f"cannot reach the Ray cluster at {address}: {e.strerror or e} "
                                 f"(waited up to {timeout_s:g} s; check --ray-address / RAY_ADDRESS)") from None


def connect(cfg: JobConfig, say: Callable[[str], None]) -> bool:
    """Connect to (or start) Ray within ray_connect_timeout_s; True when this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = ray_target(cfg)
    timeout = cfg.ray_connect_timeout_s
    if address == "local":
        say("starting a local Ray in this process")
        kwargs = dict(address="local", object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False)
    else:
        say(f"connecting to Ray at {address}")
        probe(address, timeout)
        kwargs = dict(address=address)
    if address == "local" or threading.current_thread() is not threading.main_thread():
        ray.init(log_to_driver=True, logging_level=logging.WARNING, **kwargs)  # our line above says it
        return True

    def give_up(signum, frame):
        raise ClusterUnavailable(f"Ray at {address} did not answer within {timeout:g} s (ray_connect_timeout_s)")

    # ray.init retries a silent address for minutes: bound it with an alarm (main thread only).
    previous = signal.signal(signal.SIGALRM, give_up)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        ray.init(log_to_driver=True, logging_level=logging.WARNING, **kwargs)  # our line above says it
    except ClusterUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to join is "cluster unavailable"
        raise ClusterUnavailable(f"cannot connect to Ray at {address}: {type(e).__name__}: {e}") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return True
