"""Import layering of the project's packages, read from the source (ast; nothing is imported).

Rules:
1. Layers: jobs -> pipeline -> adt_core. adt_core imports neither pipeline nor jobs; pipeline
   never imports jobs. Every import counts here: module-level, function-local (a deferred
   import is still a dependency) and `if TYPE_CHECKING:` ones (a type is still a dependency).
2. No import cycles between modules. Module-level and function-local imports both count: a
   function-local import that closes a circle only hides it (pipeline/s3.py <-> storage.py was
   one). Imports under `if TYPE_CHECKING:` do not count here: they never run. The only
   exceptions are the function-local imports listed in DEFERRED_EDGES, each with its reason;
   a module-level circle is never tolerated.

An import resolves to the most specific project module it names (`from pipeline import storage`
-> pipeline.storage; `import adt_core` -> the package's __init__).
"""

from __future__ import annotations

import ast
import fnmatch
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"adt_core": 0, "pipeline": 1, "jobs": 2}  # a module may import its own layer or lower ones

# Function-local imports that close a circle, known and owned elsewhere:
# {(importing module, imported module pattern): why it is tolerated}. They are left out of the
# cycle check; an entry that matches no import any more fails the test, so it is removed once fixed.
DEFERRED_EDGES: dict[tuple[str, str], str] = {}  # none: every circle is fixed, none tolerated


@dataclass(frozen=True)
class Import:
    source: str  # importing module, e.g. pipeline.storage
    target: str  # imported project module
    kind: str  # "module" | "function" | "type" (under `if TYPE_CHECKING:`)
    line: int


def module_names(root: Path, packages=tuple(LAYERS)) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


class _Collector(ast.NodeVisitor):
    def __init__(self, name: str, is_package: bool, modules: dict[str, Path]):
        self.name, self.is_package, self.modules = name, is_package, modules
        self.found: list[Import] = []
        self._function = 0
        self._typing = 0

    def _kind(self) -> str:
        return "type" if self._typing else "function" if self._function else "module"

    def _resolve(self, dotted: str) -> str | None:
        """The most specific project module `dotted` names (None outside the project)."""
        while dotted and dotted not in self.modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def _add(self, dotted: str, line: int) -> None:
        target = self._resolve(dotted)
        if target and target != self.name:
            self.found.append(Import(self.name, target, self._kind(), line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: from the package holding this module
            pkg = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([node.module] if node.module else []))
        for alias in node.names:  # `from pkg import mod` names a module; `from mod import f` the module
            self._add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base, node.lineno)

    def _visit_function(self, node: ast.AST) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _visit_function

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        typing_only = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        self._typing += typing_only
        for child in node.body:
            self.visit(child)
        self._typing -= typing_only
        for child in node.orelse:
            self.visit(child)


def project_imports(root: Path = ROOT) -> list[Import]:
    modules = module_names(root)
    found: list[Import] = []
    for name, path in modules.items():
        collector = _Collector(name, path.name == "__init__.py", modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found.extend(collector.found)
    return list(dict.fromkeys(found))  # `from m import a, b` names m once


def layer_violations(imports: list[Import]) -> list[str]:
    return [f"{i.source} imports {i.target} (line {i.line}, {i.kind}-level): an arrow up the layers"
            for i in imports if LAYERS[i.target.split(".")[0]] > LAYERS[i.source.split(".")[0]]]


def deferred(i: Import, allowed: dict[tuple[str, str], str]) -> bool:
    """A function-local import listed in `allowed`."""
    return i.kind == "function" and any(i.source == s and fnmatch.fnmatchcase(i.target, t) for s, t in allowed)


def cycles(imports: list[Import], allowed: dict[tuple[str, str], str] | None = None) -> list[frozenset[str]]:
    """Strongly connected groups of 2+ modules over the imports that run (Tarjan), leaving
    out the function-local imports in `allowed`."""
    graph: dict[str, set[str]] = {}
    for i in imports:
        if i.kind != "type" and not deferred(i, allowed or {}):
            graph.setdefault(i.source, set()).add(i.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _describe(group: frozenset[str], imports: list[Import]) -> str:
    edges = [f"{i.source} -> {i.target} (line {i.line}, {i.kind}-level)" for i in imports
             if i.source in group and i.target in group and i.kind != "type"]
    return "cycle: " + "; ".join(sorted(edges))


# ----------------------------------------------------------------------------------------


def test_layers_point_down():
    imports = project_imports()
    assert imports, "no project imports found: the scanner is broken"
    assert layer_violations(imports) == []


def family_of_module(name: str) -> str | None:
    """adt_core.families.<family>.x -> <family>; None for the shared modules and everything else."""
    parts = name.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["adt_core", "families"] else None


def test_families_import_no_other_family_and_the_round_no_family():
    """families -> (contract, registry, layers, vqgan, weights, text), never family -> family; the round
    (adt_core/round/), the engine, calibrate and memory import no family (they read the contract)."""
    bad = []
    for i in project_imports():
        src, dst = family_of_module(i.source), family_of_module(i.target)
        if src and dst and src != dst:
            bad.append(f"{i.source} imports {i.target} (line {i.line}): family -> family")
        generic = i.source.startswith("adt_core.round") or i.source in (
            "adt_core.engine", "adt_core.calibrate", "adt_core.memory")
        if generic and dst:
            bad.append(f"{i.source} imports {i.target} (line {i.line}): the round imports a family")
    assert bad == []


def test_no_import_cycles():
    imports = project_imports()
    assert [_describe(g, imports) for g in cycles(imports, DEFERRED_EDGES)] == []
    stale = [edge for edge in DEFERRED_EDGES if not any(deferred(i, {edge: ""}) for i in imports)]
    assert stale == [], "these imports are gone: remove them from DEFERRED_EDGES"


@pytest.fixture
def tiny_tree(tmp_path):
    """A made-up project with one arrow up and one hidden circle, to show the checks can fail."""
    files = {
        "adt_core/__init__.py": "",
        "adt_core/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from adt_core import b\n",
        "adt_core/b.py": "import adt_core.a\n",
        "pipeline/__init__.py": "",
        "pipeline/s.py": "from pipeline.t import X\n",
        "pipeline/t.py": "def f():\n    from . import s\n",  # a circle hidden in a function
        "pipeline/u.py": "def g():\n    import jobs.cli\n",  # an arrow up
        "jobs/__init__.py": "",
        "jobs/cli.py": "from pipeline import s\nimport numpy\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_checks_can_fail(tiny_tree):
    imports = project_imports(tiny_tree)
    assert layer_violations(imports) == ["pipeline.u imports jobs.cli (line 2, function-level): an arrow up the layers"]
    assert cycles(imports) == [frozenset({"pipeline.s", "pipeline.t"})]  # a <-> b is type-only: not a cycle
    assert cycles(imports, {("pipeline.t", "pipeline.*"): "tolerated"}) == []
    assert cycles(imports, {("pipeline.s", "pipeline.t"): "module-level: never tolerated"}) != []
    assert Import("jobs.cli", "pipeline.s", "module", 1) in imports
