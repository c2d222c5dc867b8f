"""infra/: the example configs stay valid, and the local object store script really serves S3."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from pipeline.config import load_config
from pipeline_helpers import simple_rows, write_prompts

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_example_job_config_is_valid():
    cfg = load_config(INFRA / "job.example.yaml")
    assert cfg.output.startswith("s3://") and cfg.resume and cfg.num_actors == 8


def test_manifests_parse():
    docs = list(yaml.safe_load_all((INFRA / "kuberay-rayjob.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayJob"]
    job_yaml = yaml.safe_load(docs[0]["data"]["job.yaml"])
    from pipeline.config import build_config

    assert build_config(job_yaml).num_actors == docs[1]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"]
    assert "jobs.generate" in docs[1]["spec"]["entrypoint"]
    cluster = yaml.safe_load((INFRA / "ray-cluster.yaml").read_text())
    assert cluster["available_node_types"]["gpu_worker"]["resources"]["GPU"] == 1
    subprocess.run(["bash", "-n", str(INFRA / "cron" / "scheduled_generate.sh")], check=True)


def test_local_s3_script_serves_and_stops(tmp_path, aws_env):
    import boto3

    src = write_prompts(tmp_path / "prompts.parquet", simple_rows(2))
    proc = subprocess.Popen([sys.executable, str(INFRA / "local_s3.py"), "--port", "0", "--bucket", "bucket-one",
                             "--upload", str(src)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ))
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("export AWS_EC2_METADATA_DISABLED"):
                break
        endpoint = next((ln.split("=", 1)[1].strip() for ln in lines if ln.startswith("export AWS_ENDPOINT_URL=")), "".join(lines))
        assert endpoint.startswith("http://127.0.0.1:")
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        assert s3.head_object(Bucket="bucket-one", Key="prompts/prompts.parquet")["ContentLength"] == src.stat().st_size
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "stopped" in rest
