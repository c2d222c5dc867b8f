"""Checks the driver makes before anything is written or Ray starts: the engine's own
decode config (every sub-config field, and the sampling it resolves to with the bundle's
defaults) and that the bundle resolves. Failures are `JobRefused` with one line naming the
field (exit code 2 unless said otherwise)."""

from __future__ import annotations

import json

from pipeline.config import JobConfig


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
        from adt_core.models.bundle import resolve_bundle_dir

        meta = json.loads((resolve_bundle_dir(cfg.bundle) / "bundle.json").read_text())
        return SamplingConfig(**meta["sampling"])
    except (OSError, KeyError, ValueError, TypeError):
        return SamplingConfig()


def check_engine_config(cfg: JobConfig) -> None:
    """Build the engine's whole DecodeConfig (and the sampling it resolves to) now, so a bad
    field is refused in one line naming it, not inside every actor after Ray started."""
    import dataclasses

    from adt_core import AdaptiveConfig, DecodeConfig, LanternConfig

    d = cfg.decode.engine_dict("cpu")
    for name, cls in (("adaptive", AdaptiveConfig), ("lantern", LanternConfig)):
        sub = d.get(name)
        if isinstance(sub, dict):
            unknown = sorted(set(sub) - {f.name for f in dataclasses.fields(cls)})
            if unknown:
                raise JobRefused(f"invalid job config: decode.{name}: unknown field(s) {', '.join(unknown)}")
    try:
        dc = DecodeConfig.from_dict(d)
        dc.sampling(_bundle_sampling(cfg))
    except (ValueError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        head = msg.split(" ", 1)[0].split(".", 1)[0]
        where = "decode." if head in set(d) | {"adaptive", "lantern", "tree", "sampling"} else "decode: "
        raise JobRefused(f"invalid job config: {where}{msg}") from None


def check_bundle(cfg: JobConfig) -> None:
    """A bundle name or path must resolve here (the driver runs beside the workers' image)."""
    if cfg.bundle == "random" or cfg.bundle.startswith("random:"):
        return
    from adt_core.models.bundle import resolve_bundle_dir

    try:
        resolve_bundle_dir(cfg.bundle)
    except (FileNotFoundError, OSError) as e:
        raise JobRefused(f"bundle {cfg.bundle!r} not found: {e} (use --bundle random for a tiny random model)") from None
