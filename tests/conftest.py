"""Shared fixtures: the tiny task's assets and tokenizer, a one-rank process group, a local S3 endpoint (moto server),
artifact roots on both backends, the test output folder."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from filelock import FileLock

from infra.ray_cluster import free_port

MOTO_BUCKET = "rlhf-test"
# What tests save for a person to look at (screenshots); listed at the end of the test report.
TEST_OUTPUT_DIR = Path(__file__).resolve().parent.parent / "test-output"
_SESSION_STARTED = time.time()


def replace_stored(fs, path: str, data: bytes) -> None:
    """Write `data` at `path` in a committed version, as a failing disk or an intruder would: over a file (a local
    store makes committed files read-only, their folders stay writable: removed first, which works without root
    too), or as a file the manifest does not list."""
    if fs.exists(path):
        fs.rm_file(path)
    fs.pipe_file(path, data)


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]):
    """`build(folder)`'s result, built once per test session even when pytest-xdist runs the session in several
    worker processes: the first worker builds under a lock in the folder all workers share, the others wait and
    reuse it (pickled result). A build that failed is tried again by the next worker that needs it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-of-<user>/pytest-N/: the workers' common parent
    folder, result = root / f"built-{name}", root / f"built-{name}.pickle"
    with FileLock(root / f"built-{name}.lock"):
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            value = build(folder)
            result.write_bytes(pickle.dumps(value))
        return pickle.loads(result.read_bytes())


# How the two pytest-xdist workers share the suite (`--dist loadscope`, pyproject.toml). A file runs in one worker, its
# module fixtures (a Prefect server, an operated night, a Ray head) built once there; the files whose tests share
# only the session's built-once fixtures spread test by test. The longest units go first, so that the short ones
# fill the end of the run instead of one worker finishing a long file alone.
SPREAD_FILES = ("test_rl.py", "test_stages.py", "test_ring_attention.py")
LONGEST_FIRST = ("test_pipeline.py", "test_deployment.py", "test_rehearsals.py", "test_rl.py", "test_stages.py",
                 "test_real_model.py", "test_bench.py", "test_orchestration.py", "test_rollout.py", "test_transient.py")


def pytest_configure(config):
    """The xdist workers share the machine's cores: each worker's stages compute with its share (RLHF_CPU_CORES, read
    by stages/distributed.py; OMP_NUM_THREADS for this process, before the tests import torch, and the processes the
    tests start). Threads beyond the free cores spin in OpenMP's barriers: two tiny RL stages side by side on 2 cores
    take twice as long with 2 threads each as with 1."""
    if not hasattr(config, "workerinput"):  # one process (-n 0), or xdist's controller, which runs no test
        return
    cores = str(max(1, (os.cpu_count() or 1) // config.workerinput["workercount"]))
    os.environ.setdefault("RLHF_CPU_CORES", cores)
    os.environ.setdefault("OMP_NUM_THREADS", cores)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with a file as the scope, but a test of SPREAD_FILES as its own (xdist's loadgroup marks
    no longer reach the scheduler under pytest 9's node ids)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTestScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if Path(path).name in SPREAD_FILES else path

    return FileOrTestScheduling(config, log)


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> dict[str, Path]:
    """The tiny model, tokenizer and datasets (seed 0), built once; no test writes into them."""
    from stages.tiny import build_tiny_assets

    return built_once(tmp_path_factory, "tiny", lambda folder: build_tiny_assets(folder, seed=0))


# The tiny preset's SFT (3 epochs of 75 steps of 32 examples), a checkpoint every 50 steps, on 2 ranks (the preset
# runs one): the data-parallel learning run the stage tests start from.
SFT_FLAGS = ("--num_gpus_per_node", 2, "--zero_stage", 2, "--save_steps", 50, "--logging_steps", 50)
SFT_STEPS = 225


@pytest.fixture(scope="session")
def sft_model(assets, tmp_path_factory) -> Path:
    """The tiny preset's SFT on noisy demonstrations (greedy answers mostly wrong, about 2.5% right), with its
    held-out loss: the start of the stage tests and of every RL test."""
    from stage_runs import run_stage

    def train(out: Path) -> Path:
        run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"], "--eval_dataset",
                  assets["sft_eval"], "--save_path", out / "model", "--ckpt_path", out / "ckpt", *SFT_FLAGS)
        return out / "model"

    return built_once(tmp_path_factory, "sft", train)


@pytest.fixture(scope="session")
def reward_model(assets, sft_model, tmp_path_factory) -> Path:
    """The tiny preset's reward model on the SFT model, ZeRO-3 over 2 ranks (sharded load, gathered export), with
    held-out pairs: the reward model of the RL tests."""
    from stage_runs import metrics_of, run_stage

    def train(out: Path) -> Path:
        run_stage("reward_model", "--pretrain", sft_model, "--dataset", assets["pref_train"], "--eval_dataset",
                  assets["pref_eval"], "--save_path", out / "model", "--ckpt_path", out / "ckpt", "--zero_stage", 3,
                  "--num_gpus_per_node", 2, "--micro_train_batch_size", 16)
        assert metrics_of(out / "model")["eval_accuracy"] >= 0.95
        return out / "model"

    return built_once(tmp_path_factory, "rm", train)


@pytest.fixture(scope="session")
def tokenizer(assets):
    from stages.model_io import load_tokenizer

    return load_tokenizer(assets["model"])


@pytest.fixture(scope="session")
def one_rank(tmp_path_factory):
    """A torch.distributed group of one gloo rank, for code that reduces over ranks or writes from rank 0. One for
    the session: DeepSpeed keeps the group it first joined, so a second group in the same process would not reach
    it."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_deepspeed_rank(one_rank, monkeypatch):
    """This process as rank 0 of 1 for DeepSpeed, as a rank actor sets itself up (stages/distributed.py)."""
    from stages.distributed import skip_deepspeed_shm_comm

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}.items():
        monkeypatch.setenv(name, value)
    skip_deepspeed_shm_comm()


@pytest.fixture(scope="session")
def test_output_dir() -> Path:
    TEST_OUTPUT_DIR.mkdir(exist_ok=True)
    return TEST_OUTPUT_DIR


def pytest_sessionfinish(session, exitstatus):
    from stage_runs import stop_shared_ray_head

    stop_shared_ray_head()


def pytest_terminal_summary(terminalreporter):
    saved = sorted(p for p in TEST_OUTPUT_DIR.glob("*") if p.is_file() and p.stat().st_mtime >= _SESSION_STARTED)
    if saved:
        terminalreporter.section("test outputs")
        for path in saved:
            terminalreporter.write_line(str(path))


def _wait_until_answers(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # any HTTP answer means the server is up
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}: {log_path.read_text()}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto_server did not answer on {url} within {timeout_s:.0f}s; log: {log_path}")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory) -> Iterator[str]:
    """A moto S3 server on a free port with bucket MOTO_BUCKET; yields its endpoint URL.

    Dummy AWS credentials are set for the session; the endpoint variables only inside tests using s3_root,
    so other tests' own S3 endpoints are not redirected here.
    """
    import s3fs

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_answers(url, proc, log_path)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("AWS_ACCESS_KEY_ID", "testing")
            mp.setenv("AWS_SECRET_ACCESS_KEY", "testing")
            for var in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
                mp.delenv(var, raising=False)
            fs = s3fs.S3FileSystem(endpoint_url=url, key="testing", secret="testing", skip_instance_cache=True)
            fs.mkdir(MOTO_BUCKET)
            yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def s3_root(moto_s3, monkeypatch) -> str:
    """A fresh s3://MOTO_BUCKET/<unique prefix>; AWS_ENDPOINT_URL(_S3) point at moto during the test."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    return f"s3://{MOTO_BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture(params=["file", "s3"])
def store_root(request, tmp_path) -> str:
    """An empty artifact root: a local temp folder, then an s3:// prefix on the moto server."""
    if request.param == "file":
        return str(tmp_path / "artifacts")
    return request.getfixturevalue("s3_root")
