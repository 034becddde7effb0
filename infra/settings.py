"""Orchestration settings, read from `RLHF_*` environment variables.

Every field can be set through the environment (the Prefect worker's env in production), e.g.
`RLHF_ARTIFACT_ROOT=s3://bucket/rlhf RLHF_RAY_ADDRESS=http://ray-head:8265 prefect worker start ...`.
Relative paths are resolved against the current directory when the settings are read, because Ray jobs
run in another working directory. `get_settings()` reads the environment anew on every call, so tests and
flows see changes made after import.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class Settings(BaseSettings):
    """Where artifacts, workspaces and Ray live, and how stage jobs are run and watched."""

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
    ray_address: str | None = Field(
        None,
        description="Ray Jobs API address, e.g. http://127.0.0.1:8265; unset = start a local head on demand "
        "(RLHF_RAY_ADDRESS).",
    )
    ray_auth_mode: Literal["disabled", "token"] = Field(
        "disabled",
        description="RAY_AUTH_MODE for the job client and a local head; `token` in production with "
        "RAY_AUTH_TOKEN set (RLHF_RAY_AUTH_MODE).",
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
        ["RLHF_FAULT_INJECT"],
        description="Comma-separated env var names copied from the worker into each job's env when set "
        "(RLHF_JOB_ENV_PASSTHROUGH).",
    )
    stage_module_prefix: str = Field(
        "stages",
        description="Package whose modules are the stage entrypoints: `python -m <prefix>.<stage>` "
        "(RLHF_STAGE_MODULE_PREFIX).",
    )
    code_version: str | None = Field(
        None,
        description="Code version in stage keys, e.g. the release's git commit or image tag; unset = sha256 of "
        "the stage package's and infra/'s sources (RLHF_CODE_VERSION).",
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
    result_storage: str | None = Field(
        None,
        description="Where Prefect persists task results (what makes a retried flow run skip finished "
        "stages): a path, file:// or s3:// URI, or `block:<type>/<name>` of a saved storage block; "
        "unset = <workspace_root>/prefect-results. Every worker must be able to read it "
        "(RLHF_RESULT_STORAGE).",
    )

    @field_validator("job_env_passthrough", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("workspace_root", mode="after")
    @classmethod
    def _absolute_workspace(cls, value: Path) -> Path:
        return value.expanduser().resolve()

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
        """Ray runtime_env for stage jobs: ship the code (remote) or point PYTHONPATH at it (local)."""
        env = self.job_env()
        if self.job_working_dir:
            return {
                "working_dir": self.job_working_dir,
                "excludes": [".venv", ".git", ".cache", "artifacts", "output", "__pycache__"],
                "env_vars": env,
            }
        pythonpath = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p
        )
        return {"env_vars": {**env, "PYTHONPATH": pythonpath}}

    def result_storage_block(self) -> Path | str:
        """Prefect `result_storage`: a local path, or the slug of a saved storage block.

        Prefect only takes saved blocks, so an fsspec URI (s3://...) is saved once as a
        `remote-file-system` block named after it; its credentials come from each worker's environment.
        """
        value = self.result_storage
        if value is None:
            return self.workspace_root / "prefect-results"
        if value.startswith("block:"):
            return value.removeprefix("block:")
        if value.startswith("file://"):
            return Path(value.removeprefix("file://"))
        if "://" in value:
            from prefect.filesystems import RemoteFileSystem

            name = "rlhf-results-" + hashlib.sha256(value.encode()).hexdigest()[:12]
            RemoteFileSystem(basepath=value).save(name, overwrite=True)
            return f"remote-file-system/{name}"
        return Path(value).expanduser().resolve()

def get_settings(**overrides) -> Settings:
    """Settings from the current environment, with keyword overrides on top."""
    return Settings(**overrides)
