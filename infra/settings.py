"""Orchestration settings, read from `RLHF_*` environment variables.

Every field can be set through the environment (the Prefect worker's env in production), e.g.
`RLHF_ARTIFACT_ROOT=s3://bucket/rlhf RLHF_RAY_ADDRESS=http://ray-head:8265 prefect worker start ...`.
Relative paths are resolved against the current directory when the settings are read, because Ray jobs
run in another working directory. `get_settings()` reads the environment anew on every call, so tests and
flows see changes made after import.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from infra.artifacts import StoreSettings
from infra.net import is_loopback
from infra.secrets import REDACTING_SETUP_HOOK, is_secret_name

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The project's own reward and agent files: its configs and its stages' package (a checkout and an installed wheel
# alike), never the rest of the checkout (the default workspace and artifact root are in it) or of site-packages.
PROJECT_REWARD_DIRS = (PROJECT_ROOT / "configs", PROJECT_ROOT / "stages")


class Settings(StoreSettings):
    """Where artifacts, workspaces and Ray live, and how stage jobs are run and watched (with the artifact store's
    own retry and clean-up settings, infra/artifacts.py)."""

    model_config = SettingsConfigDict(env_prefix="RLHF_", extra="ignore")

    artifact_root: str | None = Field(
        None,
        description="Artifact store root (a path, file:// or s3:// URI) that overrides the pipeline config's "
        "artifact_root (default ./artifacts), e.g. to pin a worker to a bucket (RLHF_ARTIFACT_ROOT).",
    )
    workspace_root: Path = Field(
        Path("./.cache/workspace"),
        description="Stage staging dirs (config, output/, ckpt/); must be visible to the Prefect worker "
        "and every Ray node, i.e. local or a shared filesystem (RLHF_WORKSPACE_ROOT).",
    )
    deployments_file: Path = Field(
        PROJECT_ROOT / "prefect.yaml",
        description="The deployments as installed on this worker: a deployment's run refuses to start when the "
        "server's copy of its parameters or job variables differs from this file's (any API user can change "
        "the server's) (RLHF_DEPLOYMENTS_FILE).",
    )
    gpu_memory_gib: float = Field(
        80.0, gt=0,
        description="Memory of one GPU of the cluster, for the plan's per-GPU memory table and fit check "
        "(RLHF_GPU_MEMORY_GIB; 80 for A100/H100 80 GB, 141 for H200).",
    )
    ray_address: str | None = Field(
        None,
        description="Ray Jobs API address, e.g. http://127.0.0.1:8265; unset = start a local head on demand "
        "(RLHF_RAY_ADDRESS).",
    )
    bind_host: str = Field(
        "127.0.0.1",
        description="Address the local Ray head listens on (GCS, raylet, dashboard, client server, agents; "
        "stage ranks follow it). Loopback by default: anything else exposes the head to the network and is "
        "an explicit choice, which turns Ray token auth on; with RLHF_RAY_AUTH_MODE=disabled it is refused (an "
        "open Jobs API runs any command it is sent) (RLHF_BIND_HOST).",
    )
    ray_auth_mode: Literal["disabled", "token"] | None = Field(
        None,
        description="RAY_AUTH_MODE for the job client and a local head; unset = `token` when bind_host is "
        "not a loopback address, else `disabled` (refused with a non-loopback bind_host). Use `token` with "
        "RAY_AUTH_TOKEN for production clusters (RLHF_RAY_AUTH_MODE).",
    )
    ray_http_timeout_s: float = Field(
        30.0, gt=0,
        description="Seconds one HTTP call to the Ray Jobs API may take (status, logs, submit, stop): a cluster "
        "that stops answering fails the watch instead of hanging it past the stage deadline "
        "(RLHF_RAY_HTTP_TIMEOUT_S).",
    )
    ray_num_cpus: int | None = Field(
        None,
        description="CPUs a local head offers; unset = the machine's cores. A stage whose placement groups "
        "need more never starts (it waits until its deadline) (RLHF_RAY_NUM_CPUS).",
    )
    job_python: str = Field(
        sys.executable,
        description="Python executable of stage jobs; the default fits local heads, use `python` for "
        "clusters with their own image (RLHF_JOB_PYTHON).",
    )
    job_working_dir: str | None = Field(
        None,
        description="Ray runtime_env working_dir uploaded with each job (remote clusters without the "
        "project installed); unset = PYTHONPATH points at the project root (RLHF_JOB_WORKING_DIR).",
    )
    job_env_passthrough: Annotated[list[str], NoDecode] = Field(
        [],
        description="Comma-separated env var names copied from the worker into each job's env when set. "
        "Secret names (*_TOKEN, *_SECRET*, *_KEY, AWS_*) are refused: Ray keeps a job's env in its job info; "
        "give the cluster its own credentials (RLHF_JOB_ENV_PASSTHROUGH).",
    )
    stage_module_prefix: str = Field(
        "stages",
        description="Package whose modules are the stage entrypoints: `python -m <prefix>.<stage>` "
        "(RLHF_STAGE_MODULE_PREFIX).",
    )
    code_version: str | None = Field(
        None,
        description="Code version in stage keys, e.g. the release's git commit or image tag; unset = sha256 of "
        "the sources each stage's job can import (pipeline/code.py) (RLHF_CODE_VERSION).",
    )
    poll_interval_s: float = Field(
        5.0, gt=0, description="Seconds between job status/log polls (RLHF_POLL_INTERVAL_S)."
    )
    stage_deadline_s: float = Field(
        48 * 3600.0,
        gt=0,
        description="Wall-clock limit of one job attempt; the job is stopped when it passes "
        "(RLHF_STAGE_DEADLINE_S).",
    )
    max_retries: int = Field(
        2, ge=0, description="Retries of a stage after a retryable failure (RLHF_MAX_RETRIES)."
    )
    retry_delay_s: float = Field(
        10.0, ge=0, description="Seconds between stage retries (RLHF_RETRY_DELAY_S)."
    )
    zombie_after_s: int = Field(
        120,
        ge=40,
        description="A flow run of a deployment that sent no heartbeat for this long is marked Crashed (so the "
        "UI offers Retry) by the automation `python -m flows.server_setup` creates; keep it above twice the "
        "flow runs' PREFECT_FLOWS_HEARTBEAT_FREQUENCY (30 s, the work pool's template) (RLHF_ZOMBIE_AFTER_S).",
    )
    max_crash_retries: int = Field(
        2,
        ge=0,
        description="Automatic retries of a crashed flow run in a row (the `--retry-crashed` automation of "
        "`python -m flows.server_setup`) after which the run fails instead of running again "
        "(RLHF_MAX_CRASH_RETRIES).",
    )
    result_storage: str | None = Field(
        None,
        description="Where Prefect persists task results, as JSON (what makes a retried flow run skip finished "
        "stages): a path, file:// or s3:// URI; unset = <PREFECT_HOME>/rlhf-results. Every worker must be able "
        "to read it and no job may write it: it is refused inside the workspace root, which every job writes "
        "(RLHF_RESULT_STORAGE).",
    )
    reward_dirs: Annotated[list[Path], NoDecode] = Field(
        [],
        description="Comma-separated folders, besides the project's configs/ and stages/, that local reward files "
        "(remote_rm_url *.py) may be read from, outside the workspace and a local artifact root: a reward file is "
        "code that every node runs (RLHF_REWARD_DIRS).",
    )

    @field_validator("job_env_passthrough", "reward_dirs", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("job_env_passthrough", mode="after")
    @classmethod
    def _no_secrets_in_job_env(cls, names: list[str]) -> list[str]:
        secret = [name for name in names if is_secret_name(name)]
        if secret:
            raise ValueError(
                f"RLHF_JOB_ENV_PASSTHROUGH names secret variables {secret}: Ray would store their values in the "
                "job's runtime_env, readable in the dashboard and job API; give the Ray cluster its own "
                "credentials (the local head inherits the worker's environment)"
            )
        return names

    @model_validator(mode="after")
    def _auth_follows_exposure(self) -> Settings:
        if self.ray_auth_mode is None:
            self.ray_auth_mode = "disabled" if is_loopback(self.bind_host) else "token"
        elif self.ray_auth_mode == "disabled" and not is_loopback(self.bind_host):
            raise ValueError(f"RLHF_BIND_HOST={self.bind_host} exposes the Ray head to the network and "
                             "RLHF_RAY_AUTH_MODE=disabled turns its authentication off: anyone who reaches the Jobs "
                             "API could run commands on it. Use RLHF_RAY_AUTH_MODE=token, or a loopback bind host")
        return self

    @model_validator(mode="after")
    def _results_out_of_jobs_reach(self) -> Settings:
        storage = self.result_storage
        if storage and "://" not in storage.removeprefix("file://"):
            path = Path(storage.removeprefix("file://")).expanduser().resolve()
            if path.is_relative_to(self.workspace_root):
                raise ValueError(f"RLHF_RESULT_STORAGE={storage} is inside RLHF_WORKSPACE_ROOT={self.workspace_root},"
                                 " which every stage job writes: a job could plant a result that the next retry "
                                 "loads. Keep results where only the workers write")
        return self

    @field_validator("workspace_root", mode="after")
    @classmethod
    def _absolute_workspace(cls, value: Path) -> Path:
        return value.expanduser().resolve()

    @field_validator("reward_dirs", mode="after")
    @classmethod
    def _absolute_reward_dirs(cls, dirs: list[Path]) -> list[Path]:
        return [Path(d).expanduser().resolve() for d in dirs]

    def reward_file_allowed(self, path: str | Path, artifact_root: str | None = None) -> bool:
        """Whether a local reward file lies (symlinks resolved) under the project's own reward and agent folders or
        a folder of reward_dirs, and outside what jobs write (the workspace root, a local artifact root)."""
        resolved = Path(path).expanduser().resolve()
        written_by_jobs = [self.workspace_root, *([Path(artifact_root).expanduser().resolve()]
                                                  if artifact_root and "://" not in artifact_root else [])]
        if any(resolved.is_relative_to(folder) for folder in written_by_jobs):
            return False
        return any(resolved.is_relative_to(folder) for folder in (*PROJECT_REWARD_DIRS, *self.reward_dirs))

    @field_validator("artifact_root", mode="after")
    @classmethod
    def _absolute_artifact_root(cls, value: str | None) -> str | None:
        return value if value is None or "://" in value else str(Path(value).expanduser().resolve())

    def job_env(self) -> dict[str, str]:
        """Env vars every stage job gets: pass-through names that are set, plus thread and Ray hygiene."""
        env = {name: os.environ[name] for name in self.job_env_passthrough if name in os.environ}
        env["RAY_AUTH_MODE"] = self.ray_auth_mode
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        return env

    def job_runtime_env(self) -> dict:
        """Ray runtime_env for stage jobs: ship the code (remote) or point PYTHONPATH at it (local); every worker
        process of the job redacts its own output first (those the stage's code does not start itself too, such as
        vLLM's tensor-parallel workers)."""
        env = self.job_env()
        hook = {"worker_process_setup_hook": REDACTING_SETUP_HOOK}
        if self.job_working_dir:
            return {
                "working_dir": self.job_working_dir,
                "excludes": [".venv", ".git", ".cache", "artifacts", "output", "__pycache__"],
                "env_vars": env,
                **hook,
            }
        pythonpath = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        return {"env_vars": {**env, "PYTHONPATH": pythonpath}, **hook}


def get_settings(**overrides) -> Settings:
    """Settings from the current environment, with keyword overrides on top."""
    return Settings(**overrides)

