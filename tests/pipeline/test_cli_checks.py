"""What the command line refuses before Ray starts, and how it reaches Ray: config fields
(items 1, 6), actor pool caps (item 7), Ray addresses (items 8, 12)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.generate import main as cli_main
from pipeline.cluster import ClusterUnavailable, plan_actors, probe, ray_target
from pipeline.config import MIN_CPUS_PER_ACTOR, ConfigError, build_config
from pipeline.exit_codes import EXIT_BAD_INPUT, EXIT_NO_RESOURCES
from pipeline_helpers import simple_rows, write_prompts
from tcp_proxy import free_port

REPO = Path(__file__).resolve().parents[2]
SECRET = "hunter2-Sup3rSecret"


def _cli(tmp_path, *flags, capsys):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    code = cli_main(["--bundle", "random:0", "--input", str(src), "--output", str(tmp_path / "out"), "--no-progress",
                     *flags])
    cap = capsys.readouterr()
    return code, cap.out + cap.err


# ---- item 1: credentials in the endpoint URL are refused and never echoed


def test_endpoint_userinfo_refused_without_echoing_it(tmp_path, capsys):
    code, text = _cli(tmp_path, "--storage.endpoint-url", f"http://admin:{SECRET}@127.0.0.1:9000", capsys=capsys)
    assert code == EXIT_BAD_INPUT
    assert "storage.endpoint_url" in text and "AWS_ACCESS_KEY_ID" in text
    assert SECRET not in text and "admin:" not in text
    assert not (tmp_path / "out").exists()  # no job.json holding it
    with pytest.raises(ConfigError) as e:
        build_config({"storage": {"endpoint_url": f"https://u:{SECRET}@s3.example.com"}})
    assert SECRET not in str(e.value)


def test_endpoint_userinfo_from_the_environment_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://admin:{SECRET}@127.0.0.1:9000")
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    code = cli_main(["--bundle", "random:0", "--input", str(src), "--output", "s3://bucket/out"])
    text = "".join(capsys.readouterr())
    assert code == EXIT_BAD_INPUT and "must not contain user:password@" in text and SECRET not in text


# ---- item 6: every decode sub-config field is checked before Ray starts (exit 2, one line)


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--decode.lantern", '{"k": -5}'], "lantern.k"),
        (["--decode.lantern", '{"delta": -1}'], "lantern.delta"),
        (["--decode.lantern", '{"lam": -3}'], "lantern.lam"),
        (["--decode.lantern", '{"bogus": 1}'], "decode.lantern"),
        (["--decode.adaptive", '{"budget": "bogus"}'], "adaptive.budget"),
        (["--decode.adaptive", '{"d_min": 9, "d_max": 3}'], "adaptive.d_min"),
        (["--decode.adaptive", '{"k0": -1}'], "adaptive.k0"),
        (["--decode.adaptive", '{"init": "horizonal"}'], "adaptive.init"),
        (["--decode.adaptive", '{"mode": "bisekt"}'], "adaptive.mode"),
        (["--decode.temperature", "inf"], "decode.temperature"),
        (["--decode.top-p", "nan"], "decode.top_p"),
    ],
)
def test_bad_decode_fields_refused_before_ray(tmp_path, capsys, flags, field):
    code, text = _cli(tmp_path, *flags, capsys=capsys)
    assert code == EXIT_BAD_INPUT, text
    errors = [ln for ln in text.splitlines() if ln.startswith("error:") or ln.startswith("  ")]
    assert field in text and len(errors) <= 2 and "Traceback" not in text, text
    assert "starting a local Ray" not in text and not (tmp_path / "out").exists()


# ---- item 7: the pool is capped to what the cluster and the prompts can use


def test_pool_capped_to_cpus_and_prompts():
    huge = build_config({"num_actors": 100})
    p = plan_actors(huge, {"CPU": 2.0}, num_prompts=1000)
    assert p.num_actors == int(1.0 / MIN_CPUS_PER_ACTOR) and p.num_cpus >= MIN_CPUS_PER_ACTOR
    assert any("100 actors requested" in n and "running 4" in n for n in p.notes)
    few = plan_actors(huge, {"CPU": 64.0}, num_prompts=3)
    assert few.num_actors == 3 and any("for 3 prompt(s)" in n for n in few.notes)
    gpu = plan_actors(build_config({"num_actors": 8}), {"CPU": 16.0, "GPU": 8.0}, num_prompts=2)
    assert (gpu.device, gpu.num_actors) == ("cuda", 2)
    fixed = plan_actors(build_config({"num_actors": 10, "cpus_per_actor": 0.5}), {"CPU": 3.0}, num_prompts=100)
    assert fixed.num_actors == 4 and fixed.num_cpus == 0.5
    with pytest.raises(ConfigError, match="cpus_per_actor"):
        build_config({"cpus_per_actor": 0.01})


# ---- items 8 and 12: which Ray, reached in bounded time


def test_ray_target_is_local_unless_told():
    assert ray_target(build_config({}), env={}) == "local"  # never silently joins a `ray start` cluster
    assert ray_target(build_config({}), env={"RAY_ADDRESS": "10.0.0.1:6379"}) == "10.0.0.1:6379"
    assert ray_target(build_config({"ray_address": "local"}), env={"RAY_ADDRESS": "10.0.0.1:6379"}) == "local"
    assert ray_target(build_config({"ray_address": "auto"}), env={}) == "auto"


def test_probe_names_an_unreachable_address():
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(ClusterUnavailable, match=f"cannot reach the Ray cluster at {addr}"):
        probe(addr, timeout_s=2)
    probe("local", timeout_s=2)  # nothing to probe


def test_unreachable_ray_address_exits_3(tmp_path):
    src = write_prompts(tmp_path / "p.parquet", simple_rows(2))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    cmd = [sys.executable, "-m", "jobs.generate", "--bundle", "random:0", "--input", str(src), "--output",
           str(tmp_path / "out"), "--ray-address", f"127.0.0.1:{free_port()}", "--ray-connect-timeout-s", "3",
           "--decode.method", "ar", "--no-progress"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)  # a safety net only
    assert done.returncode == EXIT_NO_RESOURCES, done.stdout + done.stderr
    assert "cannot reach the Ray cluster at 127.0.0.1:" in done.stderr and "Traceback" not in done.stderr
    summary = tmp_path / "out" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["ok"] == 0
