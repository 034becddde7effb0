"""A Prefect server, `prefect deploy` of prefect.yaml and process workers, as an operator runs them, for the tests
that drive whole deployment runs (test_deployment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.settings import PREFECT_API_URL, temporary_settings

from infra.ray_cluster import free_port
from infra.settings import PROJECT_ROOT
from pipeline.config import load_pipeline_config

PREFECT = str(Path(sys.executable).parent / "prefect")
POOL = "rlhf-process"
NIGHTLY = "full-rlhf/llama3-8b"
STAGES = ("sft", "reward_model", "rl", "evaluate")
FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


def small_tiny_config(**sections: dict) -> dict:
    """The tiny preset cut to a few steps per training stage (these tests check operations, not learning), as the
    deployment's `config` parameter: only fields a run may set otherwise than its deployment (RunOverride; the
    evaluation's prompts are the deployment's alone), the tiny assets where the preset builds them; `sections`
    override per stage."""
    overrides = {
        "sft": {"max_samples": 128, "max_epochs": 1},
        "reward_model": {"max_samples": 64, "max_epochs": 1},
        "rl": {"max_samples": 64, "num_episodes": 1, "save_steps": 1},
    }
    for stage, values in sections.items():
        overrides[stage] = {**overrides[stage], **values}
    return load_pipeline_config("tiny", overrides).model_dump(mode="json", exclude_unset=True)


def stop_process(process: subprocess.Popen, signals=(signal.SIGTERM, signal.SIGKILL)) -> None:
    """Signal a process group we started until it exits. Not SIGINT: a test run started in the background of a shell
    (CI, nohup) passes SIGINT on ignored, and each SIGINT would be waited out."""
    for sig in signals:
        if process.poll() is not None:
            return
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            continue


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


class PrefectStack:
    """`prefect server start` on 127.0.0.1, prefect.yaml deployed to it, workers on demand; `env` is what every
    process of the stack gets (the server and the CLI too)."""

    def __init__(self, tmp: Path, env: dict[str, str] | None = None):
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(tmp / "prefect-home"),
            "PREFECT_API_URL": f"{self.url}/api",
            "PREFECT_UI_API_URL": f"{self.url}/api",  # what the UI in a browser calls
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            **(env or {}),
        }
        for name in ("RLHF_ARTIFACT_ROOT", "RLHF_RAY_ADDRESS"):
            if name not in (env or {}):
                self.env.pop(name, None)
        self.processes: list[subprocess.Popen] = []

    @property
    def database(self) -> Path:
        return Path(self.env["PREFECT_HOME"]) / "prefect.db"

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"{name}.log"
        with log.open("ab") as out:
            process = subprocess.Popen([PREFECT, *args], cwd=PROJECT_ROOT, env={**self.env, **(env or {})},
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.processes.append(process)
        return process, log

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run([PREFECT, *args], cwd=PROJECT_ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
        return done

    def up(self, setup_command: bool = True) -> PrefectStack:
        """Server healthy, set up by the project's setup command (or only the work pool made by hand, leaving
        the automations to `prefect deploy`'s build step), prefect.yaml deployed, the nightly schedule paused so
        it cannot fire into a test."""
        server, log = self.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(self.port))
        wait_for_http(f"{self.url}/api/health", server, log)
        if setup_command:  # README's, with the nightly's automatic retry
            done = subprocess.run([sys.executable, "-m", "flows.server_setup", "--retry-crashed", NIGHTLY],
                                  cwd=PROJECT_ROOT, env=self.env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0 and "automation" in done.stdout, done.stdout + done.stderr
        else:
            self.cli("work-pool", "create", POOL, "--type", "process", "--overwrite")
        self.cli("--no-prompt", "deploy", "--all")
        self.cli("--no-prompt", "deployment", "schedule", "pause", "--all")
        return self

    def start_worker(self, name: str, env: dict[str, str]) -> tuple[subprocess.Popen, Path]:
        return self.start(name, "worker", "start", "--pool", POOL, env=env)

    def settings(self):
        """Prefect's settings for talking to this server from the test process: outside them any call that needs
        an API (a client, reading a result's storage) starts a temporary server in this process, kept until exit."""
        return temporary_settings(updates={PREFECT_API_URL: f"{self.url}/api"})

    @contextmanager
    def client(self):
        with self.settings(), get_client(sync_client=True) as client:
            yield client

    def result(self, run: FlowRun):
        """A finished run's result (reading it asks the server for its default result storage)."""
        with self.settings():
            return run.state.result()

    def run_deployment(self, name: str, parameters: dict) -> FlowRun:
        with self.client() as client:
            deployment = client.read_deployment_by_name(name)
            return client.create_flow_run_from_deployment(deployment.id, parameters=parameters)

    def logs(self, flow_run_id) -> str:
        """Every log message of a flow run, oldest first (the API pages them)."""
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
        from prefect.client.schemas.sorting import LogSort

        messages, page = [], 200
        with self.client() as client:
            while batch := client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                                            limit=page, offset=len(messages), sort=LogSort.TIMESTAMP_ASC):
                messages += [log.message for log in batch]
        return "\n".join(messages)

    def wait_for_process_exits(self, flow_run_id, count: int, timeout_s: float = 120) -> None:
        """Wait until the worker has seen `count` flow-run processes of this run exit. A retry sent before the
        worker handles the exit of the failed attempt's process gets marked Crashed by that worker."""
        deadline = time.monotonic() + timeout_s
        while self.logs(flow_run_id).count("exited with status code") < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"the worker reported no exit of flow run {flow_run_id}'s process")
            time.sleep(1)

    def wait_for(self, flow_run_id, states: Iterable[StateType], timeout_s: float, logs: Path | None = None) -> FlowRun:
        """Poll the flow run until its state type is one of `states`; fail on another final state or timeout."""
        wanted = set(states)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.client() as client:
                run = client.read_flow_run(flow_run_id)
            if run.state_type in wanted:
                return run
            tail = logs.read_text(errors="replace")[-8000:] if logs else ""
            if run.state_type in FINAL - wanted:
                raise AssertionError(f"flow run {run.name} ended {run.state_type.value} ({run.state.message}), "
                                     f"expected {sorted(s.value for s in wanted)}\n{tail}")
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {run.name} still {run.state_type.value} after {timeout_s:.0f}s\n{tail}")
            time.sleep(2)

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop_process(process)
