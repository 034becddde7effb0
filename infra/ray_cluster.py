"""Reach a Ray cluster's Jobs API: a given address, or a local head started for the duration.

A local head is `ray start --head --block` run as our own child process in its own session: on exit we
signal that process (it stops the raylet, GCS and workers it started) and never call `ray stop`, which
would kill every Ray process on the machine, including other people's clusters. Its `--temp-dir` is private
too, so a plain `ray.init()` elsewhere on the machine does not discover and join it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

from infra.settings import Settings, get_settings


class RayClusterError(RuntimeError):
    """The local Ray head did not come up, or the cluster cannot be reached."""


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read what the kernel gave)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_auth_mode(mode: str) -> None:
    """Make this process's Ray clients use `mode` explicitly.

    With RAY_AUTH_MODE unset, Ray turns token auth on as soon as ~/.ray/auth_token exists (any local
    cluster may write it), after which clients without the token are rejected.
    """
    os.environ["RAY_AUTH_MODE"] = mode


def _ray_executable() -> str:
    beside_python = Path(sys.executable).parent / "ray"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("ray")
    if found is None:
        raise RayClusterError("the `ray` command is not installed next to the python or on PATH")
    return found


def _jobs_api_ready(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"{address}/api/version", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class LocalRayHead:
    """A single-node Ray cluster on this machine, started by us and stopped by us."""

    def __init__(self, num_cpus: int | None = None, auth_mode: str = "disabled", startup_timeout_s: float = 90.0):
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.auth_mode = auth_mode
        self.startup_timeout_s = startup_timeout_s
        self.address: str | None = None
        self._process: subprocess.Popen | None = None
        self._temp_dir: str | None = None
        self._log_path: Path | None = None

    def start(self) -> str:
        """Start the head and wait until its Jobs API answers; returns the Jobs API address."""
        # /tmp keeps the unix socket paths under Ray's length limit.
        self._temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
        self._log_path = Path(self._temp_dir) / "ray-start.log"
        dashboard_port = free_port()
        command = [
            _ray_executable(), "start", "--head", "--block",
            "--dashboard-host=127.0.0.1",
            f"--num-cpus={self.num_cpus}",
            f"--port={free_port()}",
            f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--temp-dir={self._temp_dir}",
            "--disable-usage-stats",
        ]  # fmt: skip
        env = {**os.environ, "RAY_AUTH_MODE": self.auth_mode, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        address = f"http://127.0.0.1:{dashboard_port}"
        deadline = time.monotonic() + self.startup_timeout_s
        while not _jobs_api_ready(address):
            if self._process.poll() is not None or time.monotonic() > deadline:
                log_tail = self._log_path.read_text(errors="replace")[-3000:]
                self.stop()
                raise RayClusterError(f"local Ray head did not start ({' '.join(command)}):\n{log_tail}")
            time.sleep(0.5)
        self.address = address
        return address

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT the `ray start --block` process (it stops what it started); escalate on its group."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            for sig, wait_s in ((signal.SIGINT, timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    if sig == signal.SIGINT:
                        process.send_signal(sig)
                    else:
                        os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Anything left in our session (workers, job drivers) goes with it.
        if process is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None
        self.address = None

    def __enter__(self) -> LocalRayHead:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextmanager
def ray_jobs_address(settings: Settings | None = None) -> Iterator[str]:
    """Yield the Jobs API address to submit to: `settings.ray_address`, or a local head for the duration."""
    settings = settings or get_settings()
    set_auth_mode(settings.ray_auth_mode)
    if settings.ray_address:
        yield settings.ray_address
        return
    with LocalRayHead(num_cpus=settings.ray_num_cpus, auth_mode=settings.ray_auth_mode) as head:
        yield head.address


def job_client(address: str, settings: Settings | None = None):
    """A JobSubmissionClient for `address`, with the auth mode from settings applied first."""
    settings = settings or get_settings()
    set_auth_mode(settings.ray_auth_mode)
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as err:
        raise RayClusterError(f"cannot reach the Ray Jobs API at {address}: {err}") from err


@contextmanager
def ray_address_in_env(settings: Settings | None = None) -> Iterator[str]:
    """`ray_jobs_address`, with RLHF_RAY_ADDRESS set for the duration so that code reading the settings
    (the stage tasks of an in-process flow) submits to the same cluster."""
    previous = os.environ.get("RLHF_RAY_ADDRESS")
    with ray_jobs_address(settings) as address:
        os.environ["RLHF_RAY_ADDRESS"] = address
        try:
            yield address
        finally:
            if previous is None:
                os.environ.pop("RLHF_RAY_ADDRESS", None)
            else:
                os.environ["RLHF_RAY_ADDRESS"] = previous
