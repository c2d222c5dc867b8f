"""Every document an entry point names (in its --help text, docstrings or messages) exists,
and `make bench` runs the side-by-side benchmark that docs/bench.md describes."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC_REF = re.compile(r"docs/[A-Za-z0-9_./-]+\.(?:md|json|png)")


def test_every_doc_the_code_names_exists():
    named = {m for d in ("jobs", "pipeline") for f in (REPO / d).rglob("*.py") for m in DOC_REF.findall(f.read_text())}
    assert "docs/pipeline.md" in named
    assert sorted(n for n in named if not (REPO / n).exists()) == []


def test_make_bench_runs_the_throughput_benchmark_and_its_doc_exists():
    dry = subprocess.run(["make", "-n", "-o", ".venv/.installed", "bench"], cwd=REPO, capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    assert "-m jobs.bench --throughput" in dry.stdout
    doc = (REPO / "docs" / "bench.md").read_text()
    for mode in ("--throughput", "--calibrate", "--sweep", "--samplers", "--cost-curves", "make bench"):
        assert mode in doc, mode
