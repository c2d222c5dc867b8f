"""Batch image generation: Parquet prompts -> images + per-image telemetry, on Ray.

    python -m jobs.generate                                  # examples/prompts.parquet, local Ray
    python -m jobs.generate --input s3://bucket/prompts/ --output s3://bucket/runs/nightly \\
        --num-actors 8 --decode.method eagle2
    ray job submit --working-dir . -- python -m jobs.generate --config job.yaml

Options come from pipeline.config.JobConfig: defaults < --config file < flags. Every
flag below is one JobConfig field (dotted names reach nested fields; `_` and `-` are the
same: --decode.batch_size 8 = --decode.batch-size 8; no abbreviations). --bundle takes a
manifest too (infra/manifests/*.yaml: LlamaGen, Anole, Lumina-mGPT, Janus-Pro). Exit codes:
0 done, 1 some rows failed (unless --allow-failures), 2 bad flag or config, prompt input, resume or
bundle, or a device that cannot hold one image, 3 Ray cluster unreachable or too small,
4 storage unavailable, 5 output in use by another job, 6 interrupted (SIGTERM/SIGINT),
7 internal error.

Before Ray starts the driver prints the memory plan (images in flight per actor, from the
device's memory; memory_plan.json in the output). While it runs: each actor prints one 'worker ready' line (bundle loading and cost table,
with their times), then progress as images finish (a bar on a terminal; in logs a line per
tenth of the images and every --progress-interval-s); --progress also shows Ray Data's and
Hugging Face's own progress output. At the end: a summary (docs/pipeline.md, "The
summary") and the command for the job's HTML report (python -m jobs.report <output>).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional

from pipeline.cli import CliParser, add_job_flags, job_overrides
from pipeline.config import ConfigError, load_config
from pipeline.driver import main_guarded
from pipeline.exit_codes import EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    p = CliParser("python -m jobs.generate", description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--print-config", action="store_true", help="Print the resolved config (job.json form) and exit.")
    add_job_flags(p)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    try:
        cfg = load_config(args.get("config"), job_overrides(args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.get("print_config"):
        print(json.dumps(json.loads(cfg.to_json()), indent=2))
        return 0
    # the project's own loggers at INFO; other libraries (botocore's "Found credentials", ...) at WARNING
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("pipeline", "jobs", "adt_core"):
        logging.getLogger(name).setLevel(logging.INFO)
    return main_guarded(cfg)


if __name__ == "__main__":
    sys.exit(main())
