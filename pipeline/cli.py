"""The project's one command-line convention: flags generated from a pydantic config tree.

Every job (`jobs.generate`, `jobs.bench`, `jobs.study`, `jobs.train_drafter`, `pipeline.bench`)
builds its parser here, so they all behave alike:

- one flag per leaf field of the job's config model: `--field` for a top-level field,
  `--section.field` for a nested one (`--decode.tree.depth`, `--storage.endpoint-url`); an
  engine sub-config is also one flag taking a JSON object (`--decode.lantern '{"delta": 0.3}'`,
  or `none`); booleans are `--flag` / `--no-flag`;
- `_` and `-` are the same in flag names: `--decode.batch_size 0` (the spelling of job.json,
  the YAML and the error messages) and `--decode.batch-size 0` both work;
- `--help` lists the flags in one argument group per config section (top-level fields may
  name a group in the model's `cli_groups`);
- abbreviations are refused (`--num-act 3` never means `--num-actors 3`);
- a bad flag prints a short usage line and one error line (with the closest flag when there
  is one) and exits 2, the jobs' "bad config" exit code.

Values are checked by pydantic when the config is built, so a bad one names its field.
"""

from __future__ import annotations

import argparse
import difflib
import sys
import typing
from typing import Any, Iterable, Literal, NoReturn, Optional, Sequence

from pydantic import BaseModel

from pipeline.config import FieldSpec, JobConfig, leaf_fields, parse_cli_value

EXIT_BAD_FLAG = 2  # argparse's own code; every job documents 2 as "bad config"
TOP_GROUP = "options"


class CliParser(argparse.ArgumentParser):
    """argparse with the convention above: no abbreviations, `_` == `-` in flag names, and a
    short usage line + one error line on a bad flag."""

    def __init__(self, prog: str, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        kwargs.setdefault("usage", f"{prog} [options]  (--help lists them)")
        super().__init__(prog=prog, allow_abbrev=False, **kwargs)

    def _canonical(self, token: str) -> str:
        """`--a.b_c[=v]` -> `--a.b-c[=v]` when that is a flag of this parser (else unchanged)."""
        if not token.startswith("--") or token == "--":
            return token
        name, sep, value = token.partition("=")
        dashed = name.replace("_", "-")
        return dashed + sep + value if dashed in self._option_string_actions else token

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        cut = argv.index("--") if "--" in argv else len(argv)
        argv = [self._canonical(a) for a in argv[:cut]] + argv[cut:]
        return super().parse_known_args(argv, namespace)

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}{self._hint(extras)}")
        return parsed

    def _hint(self, extras: list[str]) -> str:
        flags = [s for s in self._option_string_actions if s.startswith("--")]
        for token in extras:
            if token.startswith("--"):
                close = difflib.get_close_matches(token.partition("=")[0].replace("_", "-"), flags, n=1, cutoff=0.6)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_FLAG, f"{self.prog}: error: {message}\n")


def flag_name(dotted: str) -> str:
    """The flag of a dotted field name as --help shows it: `--decode.batch-size`."""
    return "--" + dotted.replace("_", "-")


def _help(spec: FieldSpec) -> str:
    text = spec.description
    if typing.get_origin(spec.annotation) is Literal:
        text += f" Choices: {', '.join(map(str, typing.get_args(spec.annotation)))}."
    if spec.required:
        text += " [required]"
    elif spec.default is not None and spec.annotation is not bool:
        text += f" [default: {spec.default}]"
    elif spec.optional and spec.annotation is not bool:
        text += " [default: none]"
    return text.replace("%", "%%")


def _nargs(spec: FieldSpec) -> Optional[int]:
    """A fixed-length tuple field takes that many values (`--grid 16 16`)."""
    args = typing.get_args(spec.annotation)
    if typing.get_origin(spec.annotation) is tuple and args and Ellipsis not in args:
        return len(args)
    return None


def _groups(p: argparse.ArgumentParser, model: type[BaseModel], specs: list[FieldSpec]) -> dict[str, Any]:
    """One argument group per config section (and per named group of top-level fields)."""
    groups: dict[str, Any] = {}
    for title, _ in getattr(model, "cli_groups", {}).items():
        groups[title] = p.add_argument_group(title)
    for spec in specs:
        section = _section(spec, specs)
        if section and section not in groups:
            groups[section] = p.add_argument_group(section, _section_doc(model, section))
    return groups


def _section(spec: FieldSpec, specs: list[FieldSpec]) -> str:
    """The section a flag is listed under: its parent, or itself for a whole sub-section's flag."""
    if any(s.dotted.startswith(spec.dotted + ".") for s in specs):
        return spec.dotted
    return spec.dotted.rpartition(".")[0]


def _section_doc(model: type[BaseModel], section: str) -> Optional[str]:
    info = None
    for name in section.split("."):
        info = model.model_fields.get(name)
        if info is None:
            return None
        model = _model_of(info.annotation) or model
    return info.description if info is not None else None


def _model_of(tp: Any) -> Optional[type[BaseModel]]:
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def add_config_flags(p: argparse.ArgumentParser, model: type[BaseModel], *, skip: Iterable[str] = (),
                     aliases: Optional[dict[str, Sequence[str]]] = None) -> None:
    """One flag per leaf field of `model` (given flags only reach the args, under their dotted
    name). `skip`: fields the job sets itself; `aliases`: older spellings kept working
    (dotted name -> extra flags, e.g. {"train.steps": ["--steps"]})."""
    specs = [s for s in leaf_fields(model) if s.dotted not in set(skip)]
    groups = _groups(p, model, specs)
    top = {f: title for title, fields in getattr(model, "cli_groups", {}).items() for f in fields}
    for spec in specs:
        section = _section(spec, specs)
        target = groups[section] if section else groups.get(top.get(spec.dotted, ""), p)
        names = [flag_name(spec.dotted), *(aliases or {}).get(spec.dotted, ())]
        kwargs: dict[str, Any] = {"dest": spec.dotted, "default": argparse.SUPPRESS, "help": _help(spec)}
        if spec.annotation is bool:
            target.add_argument(*names, action=argparse.BooleanOptionalAction, **kwargs)
            continue
        nargs = _nargs(spec)
        metavar = spec.dotted.rsplit(".", 1)[-1].upper()
        target.add_argument(*names, nargs=nargs, metavar=(metavar,) * nargs if nargs else metavar, **kwargs)


def config_overrides(args: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """The dotted-key overrides given on the command line, in the order given (ConfigError
    when a JSON value does not parse)."""
    specs = {s.dotted: s for s in leaf_fields(model)}
    return {k: (v if isinstance(v, (bool, list)) else parse_cli_value(specs[k], v)) for k, v in args.items() if k in specs}


def add_job_flags(p: argparse.ArgumentParser) -> None:
    """--config FILE plus one flag per JobConfig field (jobs.generate, pipeline.bench)."""
    p.add_argument("--config", metavar="FILE", help="YAML or JSON JobConfig file (a saved job.json works); flags override it.")
    add_config_flags(p, JobConfig)


def job_overrides(args: dict[str, Any]) -> dict[str, Any]:
    return config_overrides(args, JobConfig)
