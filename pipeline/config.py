"""One validated configuration tree for a generation job.

`JobConfig` is built once at the entry point (defaults < YAML/JSON file < command-line
overrides), validated by pydantic, saved as `job.json` beside the outputs and passed as a
plain dict to every worker. Every field carries its documentation; `jobs.generate --help`
is generated from these descriptions, so this file is the option reference. The `decode`
section is the engine's own DecodeConfig (pipeline/decode_config.py): its fields, defaults
and rules come from adt_core.config.

Errors name the offending field with its dotted path, e.g. ``decode.tree.depth: ...``.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
import types
import typing
from pathlib import Path
from urllib.parse import urlparse
from typing import Any, ClassVar, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.decode_config import DecodeSection, EngineFieldError, SubSection

M = typing.TypeVar("M", bound=BaseModel)
CONFIG_FILE = "job.json"
DEFAULT_INPUT = "examples/prompts.parquet"  # in a checkout; installed wheels carry a copy (packaged_input)
MIN_CPUS_PER_ACTOR = 0.25  # below this an actor (torch + a bundle) makes no progress and only costs memory
_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def not_blank(v: str) -> str:
    """A required text field's validator (`field_validator(...)(not_blank)`): empty or blank is refused."""
    if not v.strip():
        raise ValueError("must not be empty")
    return v


def packaged_input() -> Path:
    """The example prompts shipped inside the package (the default input outside a checkout)."""
    return Path(__file__).resolve().parent / "assets" / "prompts.parquet"


class ConfigError(ValueError):
    """An invalid job configuration; the message names each offending field."""


class _Strict(BaseModel):
    # Unknown keys are typos: refuse them instead of silently ignoring a setting.
    model_config = ConfigDict(extra="forbid", validate_default=True)


ROWS_PER_ENGINE_SLOT = 4  # prompts per worker call per image in flight: a finished image's slot has a next prompt


class StorageSettings(_Strict):
    """Object-store access. Credentials never live here: they come from the standard AWS
    chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE,
    instance or pod roles)."""

    endpoint_url: Optional[str] = Field(
        None, description="S3 endpoint (MinIO, moto, ...); none = AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL / AWS default."
    )
    region: Optional[str] = Field(None, description="S3 region; none = AWS_REGION / AWS_DEFAULT_REGION / us-east-1.")
    profile: Optional[str] = Field(None, description="AWS profile name for credentials; none = AWS_PROFILE / default chain.")
    retry_budget_s: float = Field(
        90.0, ge=0.0, le=3600.0, allow_inf_nan=False,
        description="Seconds a storage call keeps retrying transient failures (connection refused, timeouts, 5xx) "
        "before the store counts as unavailable (exit code 4); rides out outages shorter than this.",
    )
    timeout_s: float = Field(
        20.0, gt=0.0, le=600.0, allow_inf_nan=False,
        description="Connect / read timeout of one S3 request, in seconds (each retry is one request).",
    )

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_url(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError("must be an http(s):// URL")
        if "@" in (urlparse(v).netloc or ""):
            raise ValueError("must not contain user:password@ (it would be saved in job.json): give credentials "
                             "through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or a profile (--storage.profile)")
        return v


class JobConfig(_Strict):
    """A whole generation job: what to read, how to decode, where to write, how to scale."""

    # --help groups of the top-level fields (pipeline/cli.py); the rest are listed first.
    cli_groups: ClassVar[dict[str, tuple[str, ...]]] = {
        "scale": ("device", "device_memory_gb", "num_actors", "gpus_per_actor", "cpus_per_actor", "batch_size"),
        "output layout and ledger": ("output_format", "shard_size", "ledger_flush_rows", "telemetry_rows_per_file",
                                     "lease_ttl_s", "lease_wait_s", "allow_config_change"),
        "cluster": ("ray_address", "ray_connect_timeout_s", "gpu_wait_s", "node_lost_wait_s"),
        "console": ("progress", "progress_interval_s"),
    }

    job_id: Optional[str] = Field(
        None, description="Job name used in the default output path and telemetry; none = a timestamped id."
    )
    input: str = Field(
        DEFAULT_INPUT,
        description="Prompts: a Parquet file, a folder of Parquet files or an s3:// prefix "
        "(columns prompt_id: string unique, prompt: string, optional seed: int).",
    )
    output: Optional[str] = Field(
        None, description="Output root (path, file:// or s3:// URI); none = ./outputs/<job_id>."
    )
    bundle: str = Field(
        "emoji16",
        description="Model bundle: an embedded name, a bundle directory, a manifest (YAML / JSON naming published "
        "checkpoints, e.g. infra/manifests/anole_7b.yaml), or 'random[:seed]' (tiny random weights, for tests).",
    )
    decode: DecodeSection = Field(
        default_factory=DecodeSection,
        description="Decoding: the engine's DecodeConfig (adt_core/config.py) less its device, which each actor sets.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = one GPU per actor when the cluster has GPUs, else CPU actors; cuda = require GPUs."
    )
    device_memory_gb: Optional[float] = Field(
        None, gt=0.0, le=100000.0,
        description="Memory of one actor's device for the memory plan (GB of 10^9 bytes); none = the driver's own "
        "GPU when it has one, the host's memory for CPU actors, else each actor plans on its device.",
    )
    num_actors: int = Field(1, ge=1, le=4096, description="Generator actors (each loads the bundle once).")
    gpus_per_actor: float = Field(1.0, gt=0.0, le=8.0, description="GPUs reserved per actor on GPU clusters.")
    cpus_per_actor: Optional[float] = Field(
        None, ge=MIN_CPUS_PER_ACTOR, le=256.0,
        description="CPUs reserved per actor on CPU clusters; none = a share leaving room for reads/writes "
        f"(never below {MIN_CPUS_PER_ACTOR}: the pool is capped to what fits).",
    )
    batch_size: Optional[int] = Field(
        None, ge=1, le=65536,
        description="Prompts per worker call (a Ray Data batch, streamed through one engine); none = "
        f"{ROWS_PER_ENGINE_SLOT} x decode.batch_size (images in flight), so a finished image's slot always has a next prompt.",
    )
    output_format: Literal["files", "webdataset", "parquet"] = Field(
        "files", description="files = images/<id>.png plus images/metadata.parquet (datasets' imagefolder); "
        "webdataset = tar shards under shards/ (<key>.png, <key>.json row, <key>.txt caption); "
        "parquet = Parquet shards under shards/ with the PNG bytes inline beside the row.",
    )
    shard_size: Optional[int] = Field(
        None, ge=1, le=1_000_000,
        description="Images per shard at most (webdataset, parquet); a shard never spans two worker calls, so "
        "none = one shard per worker call (--batch-size sets it).",
    )
    limit: Optional[int] = Field(None, ge=1, description="Process only the first N prompts (in file order); none = all.")
    resume: bool = Field(False, description="Skip prompt ids whose telemetry in the output already says ok.")
    baseline_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Fraction of prompts also decoded with vanilla AR to measure the real speedup (chosen by prompt id hash).",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Base seed for prompts without a seed (mixed with the prompt id).")
    max_prompt_chars: int = Field(
        2000, ge=1, description="Prompts longer than this many characters fail as rows (the text encoder truncates tokens)."
    )
    allow_failures: bool = Field(False, description="Exit 0 even when some rows failed.")
    ray_address: Optional[str] = Field(
        None, description="Ray cluster address (host:port, ray://host:port, auto = a cluster started with ray start on "
        "this machine, local = a new in-process Ray); none = RAY_ADDRESS if set (ray job submit), else local.",
    )
    gpu_wait_s: Optional[float] = Field(
        None, ge=0.0, le=86400.0, allow_inf_nan=False,
        description="When the cluster has fewer GPUs than the actors need (GPU nodes autoscaled from zero): ask the "
        "autoscaler for them and wait up to this many seconds before device auto falls back to CPU actors or device "
        "cuda fails (exit 3); none = 0 on a new local Ray, 600 on a cluster.",
    )
    node_lost_wait_s: float = Field(
        300.0, gt=0.0, le=86400.0, allow_inf_nan=False,
        description="When every node that can host an actor has left the cluster mid-run (spot preemption): wait up "
        "this many seconds for one to join, then stop with exit 3 (what was done is kept: rerun with --resume).",
    )
    ray_connect_timeout_s: float = Field(
        30.0, gt=0.0, le=3600.0, description="Seconds to wait for the Ray cluster at ray_address before exit code 3."
    )
    lease_ttl_s: float = Field(
        300.0, ge=5.0, le=86400.0,
        description="Lifetime of the job's lease on its output (renewed every third of it while the job runs); "
        "a crashed job's lease can be taken over after this long (at once on the same host when its process is gone).",
    )
    lease_wait_s: float = Field(
        0.0, ge=0.0, le=86400.0,
        description="When another job holds the output's lease: wait up to this many seconds for it (0 = refuse at once, exit 5).",
    )
    allow_config_change: bool = Field(
        False, description="Let --resume continue an output made with a config that decides images differently."
    )
    ledger_flush_rows: int = Field(
        1, ge=1, le=100_000,
        description="Telemetry rows buffered before the driver writes them durably (1 = after every worker batch); "
        "a killed driver loses at most these rows plus the batches in flight.",
    )
    telemetry_rows_per_file: int = Field(
        100_000, ge=1, le=10_000_000, description="Rows per compacted telemetry file (parts are merged at the end of a run)."
    )
    progress: bool = Field(
        False, description="Also show other libraries' progress output: Ray Data's progress bars and per-dataset "
        "logs, Hugging Face's download and weight-loading bars (the job's own progress is always shown).",
    )
    progress_interval_s: float = Field(
        5.0, gt=0.0, le=3600.0, allow_inf_nan=False,
        description="Seconds between the driver's progress lines when no tenth of the images finished meanwhile "
        "(done / total, images/s, ETA; a bar on a terminal, plain lines in logs).",
    )
    storage: StorageSettings = Field(default_factory=StorageSettings, description="Object-store endpoint settings.")

    @field_validator("job_id")
    @classmethod
    def _job_id_safe(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not _JOB_ID_RE.match(v):
            raise ValueError(f"must match {_JOB_ID_RE.pattern} (letters, digits, . _ -), got {v!r}")
        return v

    _not_blank = field_validator("input", "bundle")(not_blank)

    @model_validator(mode="after")
    def _fill_defaults(self) -> "JobConfig":
        # Fill derived defaults once, so job.json records the values actually used.
        if self.job_id is None:
            self.job_id = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)
        if self.output is None:
            self.output = str(Path("outputs") / self.job_id)
        return self

    def rows_per_call(self) -> int:
        """Prompts per worker call (Ray Data batch)."""
        return self.batch_size or ROWS_PER_ENGINE_SLOT * self.decode.batch_size

    def config_hash(self) -> str:
        """Hash of what decides the images and rows (bundle, decoding, seeding, validation).

        Scale-out settings (actors, batch size, paths, resume) are left out, so the same job
        run on a bigger cluster or resumed keeps its hash.
        """
        decides = self.model_dump(mode="json", include={"bundle", "decode", "seed", "max_prompt_chars", "baseline_fraction"},
                                  exclude={"decode": {"batch_size"}})  # in-flight size: same images (coupled/greedy)
        if self.output_format != "files":  # one layout per output (files keeps the hashes of earlier jobs)
            decides["output_format"] = self.output_format
        return hashlib.sha256(json.dumps(decides, sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        """job.json text: the full config plus its hash."""
        d = self.model_dump(mode="json")
        d["config_hash"] = self.config_hash()
        return json.dumps(d, indent=2, sort_keys=True) + "\n"


# ----------------------------------------------------------------------------------------
# Loading: file + overrides -> JobConfig


def format_validation_error(err: ValidationError, what: str = "job config") -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<config>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        engine = (e.get("ctx") or {}).get("error")
        if isinstance(engine, EngineFieldError):  # the engine's own rule: name its field
            lines.append(f"{'.'.join(filter(None, (where, engine.field)))}: {engine.message}")
            continue
        got = e.get("input")
        secret = where.endswith("endpoint_url") or (isinstance(got, str) and "@" in got and "://" in got)
        quiet = e["type"] in ("extra_forbidden", "missing") or isinstance(got, dict) or secret
        tail = "" if quiet else f" (got {got!r})"
        lines.append(f"{where}: {msg}{tail}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML or JSON config file into a dict (JSON is YAML, so one parser serves both)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML/JSON: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping at the top level, got {type(data).__name__}")
    data.pop("config_hash", None)  # a saved job.json can be fed back in
    return data


def set_dotted(d: dict[str, Any], dotted: str, value: Any) -> None:
    """d["a"]["b"]["c"] = value for dotted = "a.b.c", creating levels as needed."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        nxt = d.get(key)
        if not isinstance(nxt, dict):
            nxt = {}
            d[key] = nxt
        d = nxt
    d[leaf] = value


def build_model(model: type[M], data: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                what: str = "job config") -> M:
    """Validate `data` (e.g. a file's contents) as `model` with dotted-key `overrides` on top
    (ConfigError naming each offending field)."""
    merged: dict[str, Any] = json.loads(json.dumps(data or {}))  # deep copy of plain data
    for key, value in (overrides or {}).items():
        set_dotted(merged, key, value)
    try:
        return model.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, what)) from None


def build_config(data: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Validate `data` (e.g. a file's contents) with dotted-key `overrides` applied on top."""
    return build_model(JobConfig, data, overrides)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Defaults < file at `path` (YAML or JSON) < `overrides` (dotted keys)."""
    return build_config(read_config_file(path) if path else {}, overrides)


# ----------------------------------------------------------------------------------------
# Introspection for the command line: one option per leaf field.


class FieldSpec(typing.NamedTuple):
    dotted: str  # "decode.tree.depth"
    annotation: Any  # the leaf type with Optional stripped
    optional: bool  # None is allowed
    default: Any
    description: str
    required: bool = False  # no default: the config file or a flag must give it


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], len(args) != len(typing.get_args(tp))
    return tp, False


def leaf_fields(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[FieldSpec]:
    """Every leaf option of the config tree, depth first, with its documentation."""
    out: list[FieldSpec] = []
    for name, info in model.model_fields.items():
        tp, optional = _strip_optional(info.annotation)
        dotted = prefix + (info.alias or name)  # an alias is the key in files and on the command line
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if issubclass(tp, SubSection):  # also settable whole: --decode.lantern '{"delta": 0.3}' or none
                whole = f"{info.description} One JSON object of the fields below."
                out.append(FieldSpec(dotted, dict, optional, None, whole))
            out.extend(leaf_fields(tp, dotted + "."))
            continue
        required = info.is_required()
        default = None if required else info.get_default(call_default_factory=True)
        out.append(FieldSpec(dotted, tp, optional, default, info.description or "", required))
    return out


def parse_cli_value(spec: FieldSpec, raw: str) -> Any:
    """Turn a command-line string into a value pydantic will validate for `spec`."""
    if spec.optional and raw.strip().lower() in ("none", "null", ""):
        return None
    origin = typing.get_origin(spec.annotation)
    if spec.annotation in (dict, list) or origin in (dict, list, tuple):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"{spec.dotted}: not valid JSON/YAML: {e}") from None
    return raw  # pydantic coerces numbers and checks literals, naming the field on failure
