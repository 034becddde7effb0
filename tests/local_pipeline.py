"""Flow runs in the test process as a user's laptop runs them: a local Ray head the stages' jobs go to, an
in-process Prefect server, results and workspaces in a test folder (tests/test_pipeline.py, test_rehearsals.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from infra.ray_cluster import LocalRayHead
from infra.settings import get_settings
from pipeline.identity import stage_code_version


@contextmanager
def local_pipeline_environment(tmp: Path) -> Iterator[LocalRayHead]:
    """A Ray head and a Prefect server for flow runs started from this process (and `prefect` / `python -m
    flows.run` commands it starts, through PREFECT_API_URL), no task retries, a stage deadline."""
    head = LocalRayHead(num_cpus=2, auth_mode="disabled")
    with pytest.MonkeyPatch.context() as env, head:
        for name, value in {
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RLHF_RAY_ADDRESS": head.address,
            "RLHF_RAY_AUTH_MODE": "disabled",
            "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
            "RLHF_RESULT_STORAGE": str(tmp / "task-results"),
            "RLHF_MAX_RETRIES": "0",
            "RLHF_POLL_INTERVAL_S": "1",
            "RLHF_STAGE_DEADLINE_S": "1200",  # a stage that hangs fails the test instead of blocking it
            "PREFECT_LOCAL_STORAGE_PATH": str(tmp / "prefect-results"),  # the flow's result, for the CLI
        }.items():
            env.setenv(name, value)
        env.delenv("RLHF_ARTIFACT_ROOT", raising=False)
        # Pinned, so that an edit of stages/ while a test runs cannot change the stage keys between a run and its
        # retry (a new key means a new workspace, without the checkpoint to resume from).
        env.setenv("RLHF_CODE_VERSION", stage_code_version(get_settings(), "rl"))
        flow_results = temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: tmp / "prefect-results"})
        with prefect_test_harness(server_startup_timeout=180), flow_results:
            yield head
