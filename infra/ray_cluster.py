"""Reach a Ray cluster's Jobs API: a given address, or a local head started for the duration.

A local head is `ray start --head --block` run as our own child process in its own session: on exit we
signal that process (it stops the raylet, GCS and workers it started) and never call `ray stop`, which
would kill every Ray process on the machine, including other people's clusters. Its `--temp-dir` is private
too, so a plain `ray.init()` elsewhere on the machine does not discover and join it.

It listens on loopback only unless `bind_host` says otherwise. Ray turns a `--node-ip-address` of 127.0.0.1
into the machine's external address, and then the GCS, raylet, agents and client server listen on every
interface; RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is Ray's own switch for a single-node, loopback-only cluster
(what it does on laptops), so a loopback head gets that instead. Ranks, vLLM and job drivers inherit it.

The embedded head of a flow run (`ray_jobs_address` without an address) is recorded in
`<workspace_root>/ray-head.json` while `ray-head.lock` is held by the flow's process. The flow stops the head
when it ends. If the flow's process is killed instead, the head and its running job live on; the next flow
run on that workspace (the retry) takes the lock, finds the record, adopts the head and re-attaches to the job
rather than starting a second head and running the stage twice. Only temp folders this project creates
(`/tmp/rlhf-ray-*`, owned by this user) are ever removed, whatever a record says.

Every HTTP call of the job client has a timeout (RLHF_RAY_HTTP_TIMEOUT_S): a cluster that stops answering mid-call
fails the call instead of hanging the watcher past the stage deadline.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil

from infra.net import is_loopback
from infra.ray_env import QUIET_HEAD_ENV
from infra.settings import Settings, get_settings

HEAD_RECORD = "ray-head.json"
ALL_INTERFACES = ("0.0.0.0", "::")
HEAD_LOCK = "ray-head.lock"
# Where local heads keep their sockets and logs; /tmp keeps the unix socket paths under Ray's length limit.
TEMP_PARENT, TEMP_PREFIX = Path("/tmp"), "rlhf-ray-"


class RayClusterError(RuntimeError):
    """The local Ray head did not come up, or the cluster cannot be reached."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read what the kernel gave)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago: all bound at once, since the kernel may hand the
    same port to two binds in a row once the first socket is closed."""
    with ExitStack() as stack:
        sockets = [stack.enter_context(closing(socket.socket(
            socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM))) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


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


def is_own_temp_dir(path: str | Path) -> bool:
    """Whether `path` is a temp folder of a local head of ours: /tmp/rlhf-ray-*, a real folder owned by this
    user (a record of a head can be edited by anyone who writes the workspace)."""
    folder = Path(path)
    if folder.parent != TEMP_PARENT or not folder.name.startswith(TEMP_PREFIX) or ".." in folder.parts:
        return False
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()


def remove_own_temp_dir(path: str | Path | None) -> None:
    if path is not None and is_own_temp_dir(path):
        shutil.rmtree(path, ignore_errors=True)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass
class HeadRecord:
    """What `ray-head.json` says about a running local head: enough to find, check and stop it."""

    address: str
    pid: int  # the `ray start --block` process, leader of the head's process group
    create_time: float  # with pid: the same process, not a later one that reused the number
    temp_dir: str
    host: str
    owner_pid: int
    started_at: str

    def process_alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.create_time
        except psutil.Error:
            return False


def _stop_process_group(pid: int, popen: subprocess.Popen | None, timeout_s: float) -> None:
    """SIGTERM the `ray start --block` process (it stops what it started); escalate on its process group, then on
    whatever of its process tree is left (job drivers run in sessions of their own). Not SIGINT: a process started in
    the background of a shell (nohup, a CI step, a service) inherits SIGINT ignored, and a head waited out 40 s."""
    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []

    def gone(wait_s: float) -> bool:
        if popen is not None:
            try:
                popen.wait(wait_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        try:  # not our child (an adopted head): poll
            psutil.Process(pid).wait(wait_s)
            return True
        except psutil.NoSuchProcess:
            return True
        except psutil.TimeoutExpired:
            return False

    try:
        os.kill(pid, signal.SIGTERM)
        if not gone(timeout_s):
            os.killpg(pid, signal.SIGKILL)
            gone(10.0)
    except ProcessLookupError:
        pass
    # Anything left in the head's session (workers) or below it goes with it.
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for process in tree:
        try:
            process.kill()  # psutil checks it is still the same process, not a reused pid
        except psutil.NoSuchProcess:
            pass


@dataclass(frozen=True)
class HeadPorts:
    """The ports a head's servers listen on, all distinct (Ray refuses a start where two components share one)."""

    gcs: int
    dashboard: int
    client_server: int
    dashboard_agent_http: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int

    @classmethod
    def pick(cls, host: str) -> HeadPorts:
        return cls(*free_ports(7, host))


# What `ray start` prints when a port we picked was taken before its server bound it; another pick fixes that.
PORT_CONFLICT_MARKERS = ("is trying to use a port number", "Address already in use", "address already in use")
START_ATTEMPTS = 3


class LocalRayHead:
    """A single-node Ray cluster on this machine, started by us (or adopted) and stopped by us."""

    def __init__(self, num_cpus: int | None = None, auth_mode: str = "disabled", bind_host: str = "127.0.0.1",
                 startup_timeout_s: float = 90.0):  # fmt: skip
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.auth_mode = auth_mode
        self.bind_host = bind_host
        self.startup_timeout_s = startup_timeout_s
        self.address: str | None = None
        self.gcs_address: str | None = None  # what ray.init(address=...) of a driver on this machine joins
        self.pid: int | None = None
        self._process: subprocess.Popen | None = None
        self._temp_dir: str | None = None
        self._log_path: Path | None = None

    @property
    def listens_everywhere(self) -> bool:
        return self.bind_host in ALL_INTERFACES

    def command(self, ports: HeadPorts) -> list[str]:
        """`ray start` for this head; every server in it listens on `bind_host`."""
        host = self.bind_host
        # On every interface, Ray picks the node's address itself; a given address is the node's.
        node_ip = [] if self.listens_everywhere else [f"--node-ip-address={host}"]
        return [
            _ray_executable(), "start", "--head", "--block",
            *node_ip,
            f"--dashboard-host={host}",
            f"--num-cpus={self.num_cpus}",
            f"--port={ports.gcs}",
            f"--dashboard-port={ports.dashboard}",
            f"--ray-client-server-port={ports.client_server}",
            f"--dashboard-agent-listen-port={ports.dashboard_agent_http}",
            f"--dashboard-agent-grpc-port={ports.dashboard_agent_grpc}",
            f"--runtime-env-agent-port={ports.runtime_env_agent}",
            f"--metrics-export-port={ports.metrics_export}",
            f"--temp-dir={self._temp_dir}",
            "--disable-usage-stats",
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        # No drain on SIGTERM (Ray waits up to 30 s for Serve proxies to quiesce): a local head serves no traffic.
        env = {**os.environ, "RAY_AUTH_MODE": self.auth_mode, "RAY_USAGE_STATS_ENABLED": "0",
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **QUIET_HEAD_ENV}
        env.pop("RAY_ADDRESS", None)
        if is_loopback(self.bind_host):
            env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # see the module docstring
        else:
            env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # set by importing stages in this process
        return env

    def start(self) -> str:
        """Start the head and wait until it is `ready`; returns the Jobs API address. A start that lost one of its
        ports to another process between the pick and the bind is retried on fresh ports."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return self._start_once(HeadPorts.pick(self.bind_host))
            except RayClusterError as error:
                if attempt == START_ATTEMPTS or not any(marker in str(error) for marker in PORT_CONFLICT_MARKERS):
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, ports: HeadPorts) -> str:
        self._temp_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=TEMP_PARENT)
        self._log_path = Path(self._temp_dir) / "ray-start.log"
        command = self.command(ports)
        with open(self._log_path, "wb") as log:
            self._process = subprocess.Popen(
                command, env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.pid = self._process.pid
        client_host = "127.0.0.1" if self.listens_everywhere else self.bind_host
        address = f"http://{_url_host(client_host)}:{ports.dashboard}"
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.ready(address):
            lost_gcs_port = self._gcs_lost_its_port()
            if lost_gcs_port or self._process.poll() is not None or time.monotonic() > deadline:
                log_tail = self._log_path.read_text(errors="replace")[-3000:]
                if lost_gcs_port:
                    log_tail += f"\nthe GCS server could not bind port {ports.gcs}: Address already in use"
                # Nothing of a head that never started is worth a graceful stop; a `ray start` still waiting for its
                # GCS answers neither SIGINT nor SIGTERM (40 s of escalation).
                self.stop(timeout_s=0)
                raise RayClusterError(f"local Ray head did not start ({' '.join(command)}):\n{log_tail}")
            time.sleep(0.5)
        os.chmod(self._temp_dir, 0o700)  # Ray makes its temp folder world-writable (0o777) on start: ours alone
        self.address = address
        self.gcs_address = f"{_url_host(client_host)}:{ports.gcs}"
        return address

    def _gcs_lost_its_port(self) -> bool:
        """The GCS server logs a failed bind at once; `ray start` gives up on it only after about 40 s of retries."""
        return any("Address already in use" in log.read_text(errors="replace")
                   for log in Path(self._temp_dir).glob("session_*/logs/gcs_server.err"))

    def ready(self, address: str) -> bool:
        """Whether the starting head serves what its users need: the Jobs API at `address`."""
        return _jobs_api_ready(address)

    @classmethod
    def adopt(cls, record: HeadRecord) -> LocalRayHead:
        """Take over a head another process started (and recorded), to watch its jobs and stop it later."""
        head = cls()
        head.address, head.pid, head._temp_dir = record.address, record.pid, record.temp_dir
        return head

    def record(self) -> HeadRecord:
        assert self.address is not None and self.pid is not None and self._temp_dir is not None
        return HeadRecord(
            address=self.address, pid=self.pid, create_time=psutil.Process(self.pid).create_time(),
            temp_dir=self._temp_dir, host=socket.gethostname(), owner_pid=os.getpid(),
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )  # fmt: skip

    def stop(self, timeout_s: float = 30.0) -> None:
        pid, process = self.pid, self._process
        self.pid = self._process = None
        if pid is not None:
            _stop_process_group(pid, process, timeout_s)
        remove_own_temp_dir(self._temp_dir)
        self._temp_dir = None
        self.address = None

    def __enter__(self) -> LocalRayHead:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def read_head_record(workspace_root: Path) -> HeadRecord | None:
    path = Path(workspace_root) / HEAD_RECORD
    try:
        return HeadRecord(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # a record cut short by a crash: nothing to adopt
        return None


@contextmanager
def _workspace_head_lock(workspace_root: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold `ray-head.lock`: one flow process at a time owns the embedded head of a workspace.

    A second flow run on the same workspace waits here until the first ends (or dies: the kernel releases a
    dead process's lock), rather than stopping a head the other still uses.
    """
    workspace_root.mkdir(parents=True, exist_ok=True)
    with open(workspace_root / HEAD_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = read_head_record(workspace_root)
            holder = f"pid {record.owner_pid} on {record.host}" if record else "another process"
            log(f"the local Ray head of {workspace_root} is in use by {holder}; waiting for it to finish")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def embedded_head(settings: Settings, log: Callable[[str], None] = print) -> Iterator[str]:
    """A local head for one flow run: the recorded head of an earlier, killed run if it still answers,
    else a new one; recorded in the workspace root while it runs, stopped at the end."""
    root = settings.workspace_root
    with _workspace_head_lock(root, log):
        record_path = root / HEAD_RECORD
        record = read_head_record(root)
        head = None
        if record is not None and record.host == socket.gethostname():
            if record.process_alive() and _jobs_api_ready(record.address):
                log(f"adopting the local Ray head at {record.address} (pid {record.pid}) left running by "
                    f"pid {record.owner_pid}: its jobs are re-attached, not submitted again")
                head = LocalRayHead.adopt(record)
            else:
                log(f"the local Ray head recorded in {record_path} (pid {record.pid}) is gone or not answering; "
                    "starting a new one")
                if record.process_alive():  # hung: stop it; a dead one's pid may belong to someone else now
                    _stop_process_group(record.pid, None, timeout_s=5.0)
                remove_own_temp_dir(record.temp_dir)
        elif record is not None:
            log(f"{record_path} records a head on host {record.host}, not this one; starting a local head")
        if head is None:
            head = LocalRayHead(num_cpus=settings.ray_num_cpus, auth_mode=settings.ray_auth_mode,
                                bind_host=settings.bind_host)  # fmt: skip
            head.start()
        tmp = record_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(head.record()), indent=1))
        os.replace(tmp, record_path)
        try:
            yield head.address
        finally:
            head.stop()
            record_path.unlink(missing_ok=True)


@contextmanager
def ray_jobs_address(settings: Settings | None = None, log: Callable[[str], None] = print) -> Iterator[str]:
    """Yield the Jobs API address to submit to: `settings.ray_address`, or the workspace's embedded head."""
    settings = settings or get_settings()
    set_auth_mode(settings.ray_auth_mode)
    if settings.ray_address:
        yield settings.ray_address
        return
    with embedded_head(settings, log) as address:
        yield address


def job_client(address: str, settings: Settings | None = None):
    """A JobSubmissionClient for `address`, with the auth mode from settings applied first and a timeout on every
    HTTP call it makes."""
    settings = settings or get_settings()
    set_auth_mode(settings.ray_auth_mode)
    from ray.job_submission import JobSubmissionClient

    class TimedJobClient(JobSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):  # every call of the SDK goes through here
            kwargs.setdefault("timeout", settings.ray_http_timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    try:
        return TimedJobClient(address)
    except (ConnectionError, OSError) as err:
        raise RayClusterError(f"cannot reach the Ray cluster at {address} (Jobs API): {err}") from err


@contextmanager
def ray_address_in_env(settings: Settings | None = None, log: Callable[[str], None] = print) -> Iterator[str]:
    """`ray_jobs_address`, with RLHF_RAY_ADDRESS set for the duration so that code reading the settings
    (the stage tasks of an in-process flow) submits to the same cluster."""
    previous = os.environ.get("RLHF_RAY_ADDRESS")
    with ray_jobs_address(settings, log) as address:
        os.environ["RLHF_RAY_ADDRESS"] = address
        try:
            yield address
        finally:
            if previous is None:
                os.environ.pop("RLHF_RAY_ADDRESS", None)
            else:
                os.environ["RLHF_RAY_ADDRESS"] = previous
