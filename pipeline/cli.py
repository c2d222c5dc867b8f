"""Command-line options generated from JobConfig: one flag per field.

Dotted names reach nested fields (`--decode.tree.depth`, `--storage.endpoint-url`); an engine
sub-config is also one flag taking a JSON object (`--decode.lantern '{"delta": 0.3}'`, or
`none`). Used by `jobs.generate` and `pipeline.bench`; values are checked by pydantic when
the config is built, so a bad one names its field.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Literal

from pipeline.config import FieldSpec, leaf_fields, parse_cli_value


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


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """--config FILE plus one flag per JobConfig field (given flags only reach the args)."""
    p.add_argument("--config", metavar="FILE", help="YAML or JSON JobConfig file (a saved job.json works); flags override it.")
    for spec in leaf_fields():
        kwargs = {"dest": spec.dotted, "default": argparse.SUPPRESS, "help": _help(spec)}
        if spec.annotation is bool:
            p.add_argument(_flag(spec), action=argparse.BooleanOptionalAction, **kwargs)
        else:
            p.add_argument(_flag(spec), metavar=spec.dotted.rsplit(".", 1)[-1].upper(), **kwargs)


def job_overrides(args: dict[str, Any]) -> dict[str, Any]:
    """The dotted-key overrides given on the command line, in the order given (ConfigError
    when a JSON value does not parse)."""
    specs = {s.dotted: s for s in leaf_fields()}
    return {k: (v if isinstance(v, bool) else parse_cli_value(specs[k], v)) for k, v in args.items() if k in specs}
