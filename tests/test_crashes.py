"""Real crashes during one deployment run of the tiny pipeline (a few steps per stage), the way production meets
them: a Prefect server, `prefect deploy`, process workers, and the embedded Ray head that the flow run starts
itself (no RLHF_RAY_ADDRESS). In that one run, in order:

- SFT: one of its rank actors is killed with SIGKILL after the first checkpoint. The job fails, the task retries,
  SFT resumes from the checkpoint and its losses continue.
- Reward model: the Prefect worker and its flow process are killed with SIGKILL while the job runs (the Ray head,
  in its own session, lives on and finishes the job). A new worker starts; the heartbeat automation marks the
  run Crashed; the run is retried; the retry adopts the recorded head and re-attaches to the job instead of
  submitting it again; its output is committed once.
- RL: the Ray head is killed with SIGKILL after RL's first checkpoint. The run fails with an error naming the
  cluster; the retry starts a new head and RL resumes from its checkpoint.

Meanwhile every listening socket of every process of the run (server, workers, flow, Ray, ranks, vLLM) is
recorded: none may listen beyond loopback.
"""

from __future__ import annotations

import ipaddress
import json
import math
import signal
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest
from prefect.client.schemas.objects import StateType
from prefect.states import Scheduled

from flows.server_setup import AUTO_RETRY_MESSAGE, RETRY_AUTOMATION_PREFIX, ZOMBIE_AUTOMATION
from infra.artifacts import open_store
from infra.ray_cluster import HEAD_RECORD, job_client, read_head_record
from infra.settings import get_settings
from pipeline.identity import stage_code_version
from tests.prefect_stack import STAGES, PrefectStack, small_tiny_config

pytestmark = pytest.mark.pipeline

AUDIT_MARKER = "RLHF_TEST_RUN_MARKER"  # every process of the run inherits it; the socket audit looks for it
ZOMBIE_AFTER_S = 45  # heartbeats come every 30 s (prefect.yaml); the minimum Prefect allows


class SocketAudit(threading.Thread):
    """Records, every second, the listening sockets of the processes whose environment carries the marker."""

    def __init__(self, marker: str):
        super().__init__(daemon=True)
        self.marker = marker
        self.seen: dict[tuple[str, str, int], str] = {}  # (kind, ip, port) -> process
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            self.sample()

    def sample(self) -> None:
        for conn in psutil.net_connections("inet"):
            listening = conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr)  # TCP, or UDP bound
            if not listening or conn.pid is None or not conn.laddr:
                continue
            try:
                process = psutil.Process(conn.pid)
                if process.environ().get(AUDIT_MARKER) != self.marker:
                    continue
                name = " ".join(process.cmdline())[:120]
            except psutil.Error:
                continue
            kind = "tcp" if conn.status == psutil.CONN_LISTEN else "udp"
            self.seen[(kind, conn.laddr.ip, conn.laddr.port)] = name

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(AUDIT_MARKER) == marker:
                found.append(process)
        except psutil.Error:
            continue
    return found


def wait_for_no_ray_processes(marker: str, timeout_s: float = 30) -> list[str]:
    """Ray processes of the run still alive after `timeout_s` (a stopped head's workers exit within seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for process in marked_processes(marker):
            try:
                command = " ".join(process.cmdline())
            except psutil.Error:
                continue
            if "gcs_server" in command or "raylet" in command or command.startswith("ray::"):
                left.append(command[:100])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def wait_until(condition, what: str, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return value


def checkpoint_step(workspace: Path, stage: str) -> int:
    steps = [json.loads(p.read_text())["step"] for p in workspace.glob(f"tiny/{stage}/*/ckpt/latest_step.json")]
    return max(steps, default=0)


def jobs_of(address: str) -> dict[str, list[str]]:
    jobs: dict[str, list] = {}
    for job in job_client(address).list_jobs():
        jobs.setdefault(job.metadata.get("stage", "?"), []).append(job)
    return {stage: [j.status.value for j in sorted(found, key=lambda j: int(j.metadata["attempt"]))]
            for stage, found in jobs.items()}  # fmt: skip


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def kill(victims: list[psutil.Process]) -> None:
    for process in victims:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def kill_worker_and_flow(worker_pid: int, head_pid: int) -> list[int]:
    """SIGKILL the worker and its flow process, not the Ray head the flow started (with its jobs) below them."""
    ray = {p.pid for p in process_tree(head_pid)}
    victims = [p for p in process_tree(worker_pid) if p.pid not in ray]
    kill(victims)
    return [p.pid for p in victims]


def kill_ray_head(head_pid: int) -> None:
    """The head node lost at once: the `ray start` process and every process under it (GCS, raylet, dashboard,
    workers, rank actors, job drivers), SIGKILL."""
    kill(process_tree(head_pid))


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("crashes")
    marker = uuid.uuid4().hex
    workspace = tmp / "workspace"
    stack = PrefectStack(tmp, env={AUDIT_MARKER: marker, "RLHF_ZOMBIE_AFTER_S": str(ZOMBIE_AFTER_S)})
    audit = SocketAudit(marker)
    audit.start()
    record: dict = {"marker": marker}
    worker_env = {
        "RLHF_WORKSPACE_ROOT": str(workspace),
        "RLHF_ARTIFACT_ROOT": str(tmp / "artifacts"),
        "RLHF_RAY_NUM_CPUS": "2",
        "RLHF_MAX_RETRIES": "1",
        "RLHF_RETRY_DELAY_S": "0",
        "RLHF_POLL_INTERVAL_S": "1",
        "RLHF_STAGE_DEADLINE_S": "1200",
        "RLHF_CODE_VERSION": stage_code_version(get_settings(), "rl"),
        "RLHF_CACHE_DIR": str(tmp / "model-cache"),
    }
    try:
        stack.up()
        worker, worker_log = stack.start_worker("worker-1", worker_env)
        config = small_tiny_config(
            sft={"max_samples": 1280, "save_steps": 5, "logging_steps": 5},  # 40 steps: time to kill a rank
            reward_model={"max_samples": 256, "save_steps": 2},
        )
        run = stack.run_deployment("full-rlhf/tiny", {"config": config})
        record["run"] = run

        # SFT: kill a rank actor after the first checkpoint.
        wait_until(lambda: checkpoint_step(workspace, "sft") >= 5, "SFT's first checkpoint", 900)
        ranks = [p for p in marked_processes(marker) if p.cmdline() and p.cmdline()[0].startswith("ray::SFTWorker")]
        assert ranks, "no SFT rank actor found"
        ranks[-1].send_signal(signal.SIGKILL)
        record["rank_killed_after_step"] = checkpoint_step(workspace, "sft")

        # Reward model: kill the worker and its flow process while the job runs; start another worker.
        head = wait_until(lambda: read_head_record(workspace), "the embedded head's record", 60)
        record["first_head"] = head
        wait_until(lambda: jobs_of(head.address).get("reward_model") == ["RUNNING"], "the reward model job", 900, 0.5)
        record["killed"] = kill_worker_and_flow(worker.pid, head.pid)
        record["killed_at"] = time.monotonic()
        worker, worker_log = stack.start_worker("worker-2", worker_env)
        crashed = stack.wait_for(run.id, {StateType.CRASHED}, timeout_s=ZOMBIE_AFTER_S + 120, logs=worker_log)
        record["crash_detected_after_s"] = time.monotonic() - record["killed_at"]
        record["crashed"] = crashed.state
        record["jobs_when_crashed"] = jobs_of(head.address)
        record["sft_failure"] = next(job for job in job_client(head.address).list_jobs()
                                     if job.metadata.get("stage") == "sft" and job.status.value == "FAILED")
        with stack.client() as client:  # the operator's Retry (the browser's click is tested in test_deployment)
            client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry", message="Retry from the UI"))

        # RL: kill the Ray head after RL's first checkpoint.
        wait_until(lambda: checkpoint_step(workspace, "rl") >= 1, "RL's first checkpoint", 900, 0.2)
        adopted = read_head_record(workspace)
        record["adopted_head"] = adopted
        record["jobs_before_head_kill"] = jobs_of(adopted.address)
        kill_ray_head(adopted.pid)
        failed = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=600, logs=worker_log)
        record["failed"] = failed.state
        record["record_after_failure"] = (workspace / HEAD_RECORD).exists()
        stack.wait_for_process_exits(run.id, 1)  # the first process was killed: the worker saw only this one
        with stack.client() as client:
            client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry", message="Retry from the UI"))

        completed = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=1200, logs=worker_log)
        record["completed"] = completed
        record["result"] = completed.state.result()
        with stack.client() as client:
            record["states"] = client.read_flow_run_states(run.id)
            record["automations"] = {automation.name for automation in client.read_automations()}
        record["logs"] = stack.logs(run.id)
        record["leftover_ray"] = wait_for_no_ray_processes(marker)
        record["record_at_end"] = (workspace / HEAD_RECORD).exists()
        record["store"] = open_store(str(tmp / "artifacts"), "tiny")
        record["workspace"] = workspace
    finally:
        audit.stop()
        stack.stop()
        # Whatever a failure left behind: the heads of the run and their processes.
        for process in marked_processes(marker):
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    record["sockets"] = audit.seen
    yield record


def test_rank_killed_mid_stage_the_task_retries_and_training_continues(crashed_run):
    assert crashed_run["jobs_when_crashed"]["sft"] == ["FAILED", "SUCCEEDED"]
    sft = crashed_run["result"].stages["sft"]
    assert sft.metrics["resumed_from_step"] >= 5 and sft.metrics["steps"] == 40
    store = crashed_run["store"]
    history = json.loads(store.read_file(store.get("sft", sft.version), "history.json"))
    assert [record["step"] for record in history] == list(range(1, 41))  # no step lost or repeated
    losses = [record["loss"] for record in history]
    assert all(math.isfinite(loss) for loss in losses)
    # The first step after the resume continues from where the checkpoint left off (a restart from the base
    # model would be back near the first loss), and training goes on improving.
    resumed = sft.metrics["resumed_from_step"]
    assert losses[resumed] < 1.25 * losses[resumed - 1] and losses[resumed] < 0.8 * losses[0], losses
    assert sum(losses[-10:]) < sum(losses[:10])
    failure = crashed_run["sft_failure"]
    assert failure.driver_exit_code == 1, failure.message  # a crash, not the test-only exit 3 of fault injection


def test_lost_worker_the_run_is_marked_crashed_and_its_job_reattached_once(crashed_run):
    crashed = crashed_run["crashed"]
    assert crashed.type == StateType.CRASHED and "No heartbeat" in crashed.message
    assert crashed_run["crash_detected_after_s"] < ZOMBIE_AFTER_S + 60
    # The setup's automatic retry is for the nightly deployment only: this tiny run was retried by hand alone.
    assert crashed_run["automations"] == {ZOMBIE_AUTOMATION, RETRY_AUTOMATION_PREFIX + "llama3-8b"}
    assert not [s for s in crashed_run["states"] if s.message == AUTO_RETRY_MESSAGE]
    # The orphaned job went on running on the head the killed flow had started, and only that one job exists.
    assert crashed_run["jobs_when_crashed"]["reward_model"] in (["RUNNING"], ["SUCCEEDED"])
    assert crashed_run["jobs_before_head_kill"]["reward_model"] == ["SUCCEEDED"]
    first, adopted = crashed_run["first_head"], crashed_run["adopted_head"]
    assert (adopted.address, adopted.pid) == (first.address, first.pid)  # adopted, not a second head
    assert f"adopting the local Ray head at {first.address}" in crashed_run["logs"]
    assert crashed_run["store"].versions("reward_model") == [1]  # committed once


def test_ray_head_killed_a_clear_failure_then_the_retry_resumes(crashed_run):
    failed = crashed_run["failed"]
    address = crashed_run["adopted_head"].address
    assert failed.type == StateType.FAILED and f"Ray cluster at {address}" in failed.message, failed.message
    assert not crashed_run["record_after_failure"]  # the failed flow cleared the dead head's record
    rl = crashed_run["result"].stages["rl"]
    assert rl.metrics["resumed_from_step"] == 1 and rl.metrics["steps"] == 2
    store = crashed_run["store"]
    assert {stage: store.versions(stage) for stage in STAGES} == {stage: [1] for stage in STAGES}
    # The last flow stopped its head: no Ray process of the run is left, and no record of one.
    assert crashed_run["leftover_ray"] == [] and not crashed_run["record_at_end"]


def test_every_socket_of_the_run_listens_on_loopback_only(crashed_run):
    sockets = crashed_run["sockets"]
    programs = " ".join(sockets.values())
    for part in ("prefect", "gcs_server", "raylet", "ray::SFTWorker", "ray::PolicyWorker", "ray::VLLMEngine"):
        assert part in programs, f"the audit saw nothing of {part}: {sorted(set(sockets.values()))}"
    exposed = {key: program for key, program in sockets.items() if not is_loopback(key[1])}
    assert exposed == {}
