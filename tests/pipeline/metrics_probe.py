"""Run by test_observability.py in its own process: a local Ray with its Prometheus
endpoint on a loopback port, a generation job in a thread, and the endpoint scraped while
the job runs until the project's metrics appear. Prints one JSON line.

The job's 48 prompts last a few seconds past its first images (~10 images/s on one loaded
core), where the metrics show up within about a second of the first images: a worker reports
every 200 ms and the endpoint is scraped every 200 ms."""

import io
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.config import build_config
from pipeline.driver import run_job

PROMPTS = 48


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def main(tmp: str, port: int, temp_dir: str) -> None:
    src = Path(tmp) / "prompts.parquet"
    pq.write_table(pa.table({"prompt_id": [f"p{i:03d}" for i in range(PROMPTS)], "prompt": ["a smiling face"] * PROMPTS,
                             "seed": list(range(PROMPTS))}), src)
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=200 * 1024**2,
             _temp_dir=temp_dir, _node_ip_address="127.0.0.1", _metrics_export_port=port,
             _system_config={"metrics_report_interval_ms": 200, "worker_niceness": 0})
    cfg = build_config({"job_id": "m", "bundle": "random:0", "input": str(src), "output": str(Path(tmp) / "out"),
                        "num_actors": 1, "batch_size": 4, "decode": {"method": "ar", "temperature": 0.0},
                        "baseline_fraction": 0.5, "progress": False})
    result = {}
    job = threading.Thread(target=lambda: result.update(r=run_job(cfg, stream=io.StringIO())), daemon=True)
    job.start()
    found, during = "", False
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        text = scrape(port)
        lines = [ln for ln in text.splitlines() if ln.startswith("ray_adt_") and not ln.startswith("#")]
        if any(ln.startswith("ray_adt_images_done") for ln in lines):
            found, during = "\n".join(lines), job.is_alive()
            break
        if not job.is_alive():
            break
        time.sleep(0.2)  # polling the endpoint for a condition, bounded by the deadline
    job.join(timeout=600)
    ray.shutdown()
    print(json.dumps({"found": found, "during_job": during, "exit_code": result["r"].exit_code if "r" in result else None}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
