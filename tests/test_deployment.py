"""prefect.yaml as an operator uses it: a real Prefect server, a process worker, a Ray head, `prefect deploy`,
`prefect deployment run full-rlhf/tiny --watch`; then the run's artifacts are checked in the store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from infra.artifacts import open_store
from infra.ray_cluster import LocalRayHead, free_port
from infra.settings import PROJECT_ROOT
from stages.config import CONFIG_DIR, load_pipeline_config

PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rlhf-process"
STAGES = ("sft", "reward_model", "rl", "evaluate")


def prefect_yaml() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())


def test_deployment_parameters_are_the_presets():
    """Each deployment's config parameter is its preset verbatim; re-copy configs/<name>.yaml if this fails."""
    deployments = {d["name"]: d for d in prefect_yaml()["deployments"]}
    assert set(deployments) == {"llama3-8b", "tiny"}
    for name, deployment in deployments.items():
        preset = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        assert deployment["parameters"]["config"] == preset, f"prefect.yaml {name}: differs from configs/{name}.yaml"
        assert deployment["entrypoint"] == "flows/full_rlhf.py:full_rlhf"
        assert deployment["work_pool"]["name"] == POOL
    nightly = deployments["llama3-8b"]
    assert nightly["schedules"][0]["cron"] and nightly["concurrency_limit"]["limit"] == 1


def quick_tiny_config(tmp: Path) -> dict:
    """The tiny preset on fewer samples: this test checks the deployment path, not learning."""
    config = load_pipeline_config(
        "tiny",
        {
            "tiny_assets_dir": str(tmp / "tiny-assets"),
            "sft": {"max_samples": 256, "max_epochs": 1},
            "reward_model": {"max_samples": 128, "max_epochs": 1},
            "rl": {"max_samples": 32, "num_episodes": 1},
            "evaluate": {"max_samples": 32},
        },
    )
    return config.model_dump(mode="json", exclude_unset=True)


def wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer; log:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


def stop(process: subprocess.Popen, signals=(signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGKILL)) -> None:
    """Signal a process group we started until it exits (a Prefect worker may need SIGINT twice)."""
    for sig in signals:
        if process.poll() is not None:
            return
        os.killpg(process.pid, sig)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.pipeline
def test_deployment_run_completes_and_commits_artifacts(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
        "RLHF_ARTIFACT_ROOT": str(tmp_path / "artifacts"),
        "RLHF_WORKSPACE_ROOT": str(tmp_path / "workspace"),
        "RLHF_RAY_AUTH_MODE": "disabled",
        "RLHF_POLL_INTERVAL_S": "1",
        "RLHF_STAGE_DEADLINE_S": "1200",
    }
    env.pop("RLHF_FAULT_INJECT", None)

    def prefect(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([PREFECT, *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
        return done

    processes: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen([PREFECT, *args], cwd=PROJECT_ROOT, env=env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        processes.append(process)
        return process, log

    with LocalRayHead(num_cpus=2, auth_mode="disabled") as head:
        env["RLHF_RAY_ADDRESS"] = head.address
        try:
            server, server_log = start("server", "server", "start", "--host", "127.0.0.1", "--port", str(port))
            wait_for_http(f"http://127.0.0.1:{port}/api/health", server, server_log)
            prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
            prefect("--no-prompt", "deploy", "--all")
            # The nightly schedule must not fire into this test.
            prefect("--no-prompt", "deployment", "schedule", "pause", "--all")
            worker, worker_log = start("worker", "worker", "start", "--pool", POOL)

            run = subprocess.run(
                [PREFECT, "deployment", "run", "full-rlhf/tiny", "--watch", "--watch-timeout", "1500",
                 "--params", json.dumps({"config": quick_tiny_config(tmp_path)})],
                cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            assert run.returncode == 0, (
                f"{run.stdout[-3000:]}\n{run.stderr[-3000:]}\nworker log:\n{worker_log.read_text()[-6000:]}"
            )
            assert "Completed" in run.stdout
        finally:
            for process in reversed(processes):
                stop(process)

    store = open_store(str(tmp_path / "artifacts"), "tiny")
    for stage in STAGES:
        assert store.versions(stage) == [1], stage
        store.verify(store.get(stage, 1))
    assert store.get("evaluate", 1).inputs["policy"].uri == store.get("rl", 1).uri
