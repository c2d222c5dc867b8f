"""Batch image generation: Parquet prompts -> images + per-image telemetry, on Ray.

    python -m jobs.generate                                  # examples/prompts.parquet, local Ray
    python -m jobs.generate --input s3://bucket/prompts/ --output s3://bucket/runs/nightly \\
        --num-actors 8 --decode.method eagle2
    ray job submit --working-dir . -- python -m jobs.generate --config job.yaml

Options come from pipeline.config.JobConfig: defaults < --config file < flags. Every
flag below is one JobConfig field (dotted names reach nested fields). Exit codes: 0 done,
1 some rows failed (unless --allow-failures), 2 bad config, prompt input or resume, 3 Ray
cluster unreachable or too small, 4 storage unavailable, 5 output in use by another job,
6 interrupted (SIGTERM/SIGINT), 7 internal error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from typing import Literal, Optional

from pipeline.config import ConfigError, FieldSpec, leaf_fields, load_config, parse_cli_value
from pipeline.driver import EXIT_BAD_INPUT, main_guarded


def _flag(spec: FieldSpec) -> str:
    return "--" + spec.dotted.replace("_", "-")


def _help(spec: FieldSpec) -> str:
    text = spec.description
    if typing.get_origin(spec.annotation) is Literal:
        text += f" Choices: {', '.join(map(str, typing.get_args(spec.annotation)))}."
    if spec.default is not None and spec.annotation is not bool:
        text += f" [default: {spec.default}]"
    elif spec.optional and spec.annotation is not bool:
        text += " [default: none]"
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jobs.generate",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # `--num-act 3` must not silently mean --num-actors
    )
    p.add_argument("--config", metavar="FILE", help="YAML or JSON JobConfig file (a saved job.json works); flags override it.")
    p.add_argument("--print-config", action="store_true", help="Print the resolved config (job.json form) and exit.")
    for spec in leaf_fields():
        kwargs = {"dest": spec.dotted, "default": argparse.SUPPRESS, "help": _help(spec)}
        if spec.annotation is bool:
            p.add_argument(_flag(spec), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            p.add_argument(_flag(spec), metavar=spec.dotted.rsplit(".", 1)[-1].upper(), **kwargs)
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = vars(build_parser().parse_args(argv))
    specs = {s.dotted: s for s in leaf_fields()}
    try:
        overrides = {k: (v if isinstance(v, bool) else parse_cli_value(specs[k], v)) for k, v in args.items() if k in specs}
        cfg = load_config(args.get("config"), overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.get("print_config"):
        print(json.dumps(json.loads(cfg.to_json()), indent=2))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return main_guarded(cfg)


if __name__ == "__main__":
    sys.exit(main())
