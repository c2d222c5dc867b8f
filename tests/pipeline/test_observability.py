"""Progress lines with a known total and an ETA; application metrics on Ray's Prometheus
endpoint during a job; the Grafana dashboard charts those metrics."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pipeline.progress import Progress, format_duration

REPO = Path(__file__).resolve().parents[2]


def test_progress_lines_have_total_rate_and_eta():
    now = [0.0]
    lines: list[str] = []
    p = Progress(100, lines.append, interval_s=10, clock=lambda: now[0])
    now[0] = 30.0  # first batch after 30 s of actor start-up
    p.add(4, 4)
    assert lines == ["progress 4/100 (4.0%), ok 4"]  # no rate yet
    now[0] = 35.0
    p.add(4, 3)  # within the interval: quiet
    now[0] = 50.0
    p.add(12, 12)
    assert lines[-1] == "progress 20/100 (20.0%), ok 19, 0.80 images/s, ETA 1m40s"  # 16 rows in 20 s, start-up left out
    now[0] = 51.0
    p.add(80, 80)
    assert lines[-1].startswith("progress 100/100 (100.0%)")  # the last row is always said
    assert format_duration(3725) == "1h02m" and format_duration(59) == "59s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_prometheus_endpoint_shows_the_projects_metrics_during_a_job(tmp_path):
    temp_dir = tempfile.mkdtemp(prefix="rmp", dir="/tmp")  # short: socket paths have a length limit
    env = dict(os.environ, PYTHONPATH=f"{REPO}", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled",
               AWS_EC2_METADATA_DISABLED="true")
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name("metrics_probe.py")), str(tmp_path),
                               str(free_port()), temp_dir], env=env, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["during_job"], got  # scraped while the job was still running
    text = got["found"]
    assert 'method="ar"' in text and 'bundle="random-0"' in text
    for name in ("ray_adt_images_done", "ray_adt_acceptance_length", "ray_adt_image_time_ms"):
        assert name in text, text[:2000]
    assert got["exit_code"] == 0


def test_grafana_dashboard_charts_the_exported_metrics():
    board = json.loads((REPO / "infra" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in board["panels"] for t in p.get("targets", []))
    for name in ("ray_adt_images_done", "ray_adt_images_failed", "ray_adt_acceptance_length_bucket",
                 "ray_adt_speedup_bucket", "ray_adt_image_time_ms_bucket"):
        assert name in exprs
    assert {v["name"] for v in board["templating"]["list"]} >= {"method", "bundle"}
