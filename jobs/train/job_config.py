"""The drafter training job's validated config tree and its exit codes (jobs/train_drafter.py).

One TrainDrafterConfig per job (defaults < --config file < flags < --set a.b=v), saved as
OUT/train_config.json; `config_hash` covers only what decides the trained weights, so a rerun
with another log interval resumes and one with another learning rate is refused.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.config import StorageSettings, build_model, not_blank, read_config_file

CONFIG_FILE = "train_config.json"
RESULT_FILE = "result.json"
EXIT_OK, EXIT_BAD_INPUT, EXIT_NO_RESOURCES, EXIT_STORAGE, EXIT_INTERRUPTED, EXIT_INTERNAL = 0, 2, 3, 4, 6, 7
EXIT_BAD_DATA, EXIT_NO_HEAD, EXIT_TRAINING_FAILED = 8, 9, 10
EXIT_CODES = {
    EXIT_OK: "done: OUT/result.json names the exported drafter",
    EXIT_BAD_INPUT: "the config, the prompt input or the bundle was refused (or OUT holds a run with another config)",
    EXIT_NO_RESOURCES: "the Ray cluster cannot be reached or cannot host the workers",
    EXIT_STORAGE: "the output is not writable, or a store is unavailable",
    EXIT_INTERRUPTED: "stopped by SIGTERM / SIGINT; run the same command again to resume",
    EXIT_INTERNAL: "an unexpected error (a bug); the traceback is logged",
    EXIT_BAD_DATA: "the training data is unusable: empty, every row failed, ids outside the codebook, or another grid",
    EXIT_NO_HEAD: "the bundle's model family has no drafter head type to train",
    EXIT_TRAINING_FAILED: "training failed: workers failed more than train.max_failures times",
}


class JobError(Exception):
    """Ends the job with one line and an exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TrainSection(_Strict):
    """The optimisation: EAGLE's recipe (feature regression + soft cross-entropy, input noise)."""

    steps: int = Field(2000, ge=1, le=10_000_000, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, le=65536, description="Images per step over all workers (each gives cond + uncond rows); "
                            "a multiple of the number of workers.")
    lr: float = Field(6e-4, gt=0, le=1.0, description="AdamW peak learning rate (linear warmup, cosine decay).")
    final_lr_frac: float = Field(0.1, ge=0, le=1, description="Learning rate at the last step, as a fraction of lr.")
    warmup: int = Field(50, ge=0, description="Warmup steps.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay on matrices.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient norm clip.")
    noise: float = Field(0.1, ge=0, le=10, description="Half-width of the uniform noise on input features (EAGLE: 0.1).")
    ce_weight: float = Field(0.1, ge=0, le=100, description="Weight of the soft cross-entropy to the target's next-code distribution.")
    ffn_dim: Optional[int] = Field(None, ge=8, description="Drafter FFN width; none = the target's.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds the drafter init, the batch order and the noise.")
    amp: Literal["auto", "bf16", "fp32"] = Field("auto", description="bf16 autocast on CUDA / native-bf16 CPUs (auto), always, or never.")
    log_every: int = Field(10, ge=1, description="Steps between metric lines (ray.train.report + metrics.jsonl).")
    ckpt_every: int = Field(100, ge=1, description="Steps between checkpoints (one is always written at the last step).")
    eval_every: int = Field(250, ge=0, description="Steps between held-out top-1 agreement measurements (0 = never).")
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept in OUT/train (the latest ones).")
    max_failures: int = Field(3, ge=-1, description="Worker-group failures recovered from the latest checkpoint (-1 = no limit).")


class EvalSection(_Strict):
    """Acceptance length of the trained drafter against its target (adt_core.Generator)."""

    prompts: Optional[str] = Field(None, description="Held-out prompt Parquet (prompt_id, prompt, seed); none = the "
                                   "held-out share of the data's prompts.")
    limit: int = Field(64, ge=0, description="Prompts evaluated at most (0 = skip the evaluation).")
    methods: list[Literal["eagle2", "adt", "static"]] = Field(["eagle2", "adt"], description="Decoding methods measured.")
    temperatures: list[Union[float, Literal["default"]]] = Field(
        [0.0, "default"], description="Temperatures measured; default = the bundle's sampling defaults.")
    batch_size: int = Field(16, ge=1, le=4096, description="Images in flight per Generator.")
    threads: int = Field(0, ge=0, le=256, description="Torch threads on the driver during evaluation (0 = torch's default).")
    max_tokens: Optional[int] = Field(None, ge=1, description="Decode only this many image tokens per prompt (smoke "
                                      "tests); none = the whole grid.")


class DataSection(_Strict):
    """The self-distilled data: the target's own images for the prompts."""

    num_actors: int = Field(1, ge=1, le=4096, description="Generator actors of the batch job.")
    decode_batch_size: int = Field(64, ge=1, le=4096, description="Images in flight per actor.")
    heldout_fraction: float = Field(0.05, ge=0, lt=1, description="Share of prompt ids (by hash) kept out of training; "
                                    "their grids give the held-out agreement metric.")


class TrainDrafterConfig(_Strict):
    """A drafter training job: which target, which prompts, where to write, how to train and scale."""

    bundle: str = Field(..., description="Target bundle: a directory, a manifest, an embedded name or random[:seed].")
    prompts: Optional[str] = Field(None, description="Training prompts: Parquet file, folder or s3:// prefix.")
    data: Optional[str] = Field(None, description="An earlier batch-job output (path or s3://) whose token grids are "
                                "reused; none = OUT/data, made from the prompts.")
    out: str = Field(..., description="Output root: a path or s3:// URI.")
    train: TrainSection = Field(default_factory=TrainSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    distill: DataSection = Field(default_factory=DataSection)
    num_workers: Optional[int] = Field(None, ge=1, le=4096, description="Ray Train workers; none = one per GPU, 2 CPU "
                                       "workers when the cluster has no GPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = GPU workers when the cluster has GPUs.")
    cpus_per_worker: Optional[float] = Field(None, gt=0, le=256, description="CPUs per CPU worker; none = the cluster's "
                                             "CPUs shared out, at most 1.")
    threads_per_worker: int = Field(1, ge=1, le=256, description="Torch threads per worker.")
    run_name: str = Field("train", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="Ray Train run name (OUT/<run_name>).")
    export_bundle: bool = Field(True, description="Also write OUT/bundle: the source bundle directory with this drafter.")
    ray_address: Optional[str] = Field(None, description="Ray cluster address; none = RAY_ADDRESS, else a new local Ray.")
    storage: StorageSettings = Field(default_factory=StorageSettings)

    _not_blank = field_validator("bundle", "out")(not_blank)

    @model_validator(mode="after")
    def _data_source(self) -> "TrainDrafterConfig":
        if self.prompts is None and self.data is None:
            raise ValueError("give the training prompts (--prompts) or an earlier output's data (--data)")
        if self.num_workers is not None and self.train.batch_size % self.num_workers:
            raise ValueError(f"train.batch_size {self.train.batch_size} is not a multiple of num_workers {self.num_workers}")
        return self

    def decides(self) -> dict[str, Any]:
        """What decides the trained weights (the bundle, the data, the train section)."""
        d = self.model_dump(mode="json", include={"bundle", "prompts", "data", "train", "distill"})
        for k in ("log_every", "eval_every", "keep_checkpoints", "max_failures"):
            d["train"].pop(k)
        d["distill"] = {"heldout_fraction": d["distill"]["heldout_fraction"]}
        return d

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.decides(), sort_keys=True).encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json") | {"config_hash": self.config_hash()}, indent=2, sort_keys=True) + "\n"


def load_config(path: Optional[str], overrides: dict[str, Any]) -> TrainDrafterConfig:
    return build_model(TrainDrafterConfig, read_config_file(path) if path else {}, overrides, what="training config")
