"""The CronJob's submit.py (infra/kuberay-cronjob.yaml), run as the pod runs it, against a
stand-in for the Kubernetes API on loopback (KubeRay's RayJob resource: create, get, delete,
its status moving Running -> Complete / Failed as the operator would set it)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "/apis/ray.io/v1/namespaces/gen/rayjobs"


class FakeRayJobAPI(ThreadingHTTPServer):
    """RayJobs in a dict; each GET of a created job advances its status one step."""

    def __init__(self, final_job_status: str, existing: set[str] = frozenset()):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.final = final_job_status
        self.jobs: dict[str, dict] = {name: {"metadata": {"name": name}} for name in existing}
        self.gets: dict[str, int] = {}
        self.log: list[tuple[str, str, str]] = []  # (method, path, Authorization header)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: FakeRayJobAPI

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _name(self) -> str | None:
        return self.path[len(PREFIX) + 1:] or None if self.path.startswith(PREFIX) else None

    def _body(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")

    def do_POST(self):
        self.server.log.append(("POST", self.path, self.headers["Authorization"]))
        job = self._body()
        self.server.jobs[job["metadata"]["name"]] = job
        self._reply(201, job)

    def do_DELETE(self):
        self.server.log.append(("DELETE", self.path, self.headers["Authorization"]))
        self._body()
        found = self.server.jobs.pop(self._name(), None)
        self._reply(200 if found else 404, {"status": "Success"} if found else {"reason": "NotFound"})

    def do_GET(self):
        self.server.log.append(("GET", self.path, self.headers["Authorization"]))
        job = self.server.jobs.get(self._name())
        if job is None:
            return self._reply(404, {"reason": "NotFound"})
        n = self.server.gets[self._name()] = self.server.gets.get(self._name(), 0) + 1
        job["status"] = ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"} if n < 2 else
                         {"jobDeploymentStatus": "Complete" if self.server.final == "SUCCEEDED" else "Failed",
                          "jobStatus": self.server.final})
        self._reply(200, job)

    def log_message(self, *args):
        pass


@pytest.fixture
def pod(tmp_path):
    """The files the pod sees: the ConfigMap's script and template, a service-account dir."""
    cm = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "infra" / "kuberay-cronjob.yaml").read_text()) if d}["ConfigMap"]
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok-123\n")
    (sa / "namespace").write_text("gen")
    return tmp_path


def submit(pod: Path, api: FakeRayJobAPI, day: str) -> subprocess.CompletedProcess:
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    env = {"PATH": "/usr/bin:/bin", "DAY": day, "KUBERNETES_API": api.url, "SERVICE_ACCOUNT_DIR": str(pod / "sa"),
           "TEMPLATE": str(pod / "rayjob.yaml"), "POLL_S": "0.01"}
    try:
        return subprocess.run([sys.executable, str(pod / "submit.py")], env=env, capture_output=True, text=True,
                              timeout=60)
    finally:
        api.shutdown()
        api.server_close()


def test_submits_the_days_rayjob_and_waits_for_success(pod):
    api = FakeRayJobAPI("SUCCEEDED")
    done = submit(pod, api, "20240601")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "rayjob adt-tree-daily-20240601: Complete / SUCCEEDED"
    job = api.jobs["adt-tree-daily-20240601"]
    assert "--job-id daily-20240601" in job["spec"]["entrypoint"] and "__DAY__" not in json.dumps(job)
    assert [m for m, _, _ in api.log] == ["DELETE", "POST", "GET", "GET"]
    assert all(auth == "Bearer tok-123" for _, _, auth in api.log)


def test_a_rerun_replaces_the_finished_day_and_a_failed_job_exits_1(pod):
    api = FakeRayJobAPI("FAILED", existing={"adt-tree-daily-20240602"})
    done = submit(pod, api, "20240602")
    assert done.returncode == 1
    assert done.stdout.splitlines()[-1] == "rayjob adt-tree-daily-20240602: Failed / FAILED"
    assert [m for m, _, _ in api.log][:3] == ["DELETE", "GET", "POST"]  # gone before it is created again
