"""Prepare a Prefect server for the full-rlhf deployments: the work pool and the automations that handle crashes.

    python -m flows.server_setup [--retry-crashed DEPLOYMENT ...]

Run it before the first `prefect deploy` (which insists on an existing work pool); every deploy then runs it again
as a build step (prefect.yaml), so the automations follow the deployments. Idempotent: existing automations are
updated in place, never duplicated.

- Work pool `rlhf-process` (process type), created if missing, its base job template set to `job_template()`: the
  command a flow run executes, its environment and working directory are fixed by the pool, not variables a
  deployment or a run may set (Prefect's default process template takes `command` and `env` from each run's job
  variables: any API user could have the worker run any command with its credentials).
- `rlhf-crash-zombie-runs`: a full-rlhf flow run that stops sending heartbeats (its worker or process was
  killed, the machine lost) without reaching a final state is marked Crashed after RLHF_ZOMBIE_AFTER_S, so the UI
  offers Retry. Flow runs send heartbeats every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (the pool's template sets
  it).
- With `--retry-crashed full-rlhf/llama3-8b`: `rlhf-retry-crashed-llama3-8b` puts a crashed run of that
  deployment back to Scheduled (AwaitingRetry), as the UI's Retry does: finished stages come back cached and the
  crashed stage re-attaches to its Ray job or resumes from its checkpoint. The flow refuses to run again after
  RLHF_MAX_CRASH_RETRIES such retries in a row and fails, so a run that crashes every time stops.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

from prefect.automations import Automation
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectNotFound

from infra.settings import get_settings

FLOW_NAME = "full-rlhf"
WORK_POOL = "rlhf-process"
ZOMBIE_AUTOMATION = "rlhf-crash-zombie-runs"
RETRY_AUTOMATION_PREFIX = "rlhf-retry-crashed-"
# The message of the state an automatic retry sets; the flow counts these to stop a crash loop.
AUTO_RETRY_MESSAGE = "Retried automatically after a crash (rlhf-retry-crashed)"
# Every flow run's environment beyond the worker's own: heartbeats every 30 s, which the zombie automation watches.
FLOW_RUN_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
FINAL_FLOW_RUN_EVENTS = {f"prefect.flow-run.{state}" for state in ("Completed", "Failed", "Cancelled", "Crashed")}


def zombie_automation(after_s: int) -> Automation:
    """Crashed, for a full-rlhf flow run whose last heartbeat is older than `after_s` and that has not ended."""
    return Automation(
        name=ZOMBIE_AUTOMATION,
        description=f"Marks {FLOW_NAME} flow runs Crashed when their heartbeats stop for {after_s}s "
        "(worker or flow process killed), so that they can be retried.",
        trigger=EventTrigger(
            posture=Posture.Proactive,
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *FINAL_FLOW_RUN_EVENTS},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
            for_each={"prefect.resource.id"},
            threshold=1,
            within=timedelta(seconds=after_s),
        ),
        actions=[ChangeFlowRunState(
            state=StateType.CRASHED,
            message=f"No heartbeat for {after_s}s: the flow run's process is gone. Retry resumes it.",
        )],
    )  # fmt: skip


def retry_crashed_automation(deployment: str) -> Automation:
    """Back to Scheduled (AwaitingRetry, like the UI's Retry) for crashed runs of `deployment` (flow/name)."""
    flow_name, _, deployment_name = deployment.rpartition("/")
    if flow_name != FLOW_NAME or not deployment_name:
        raise ValueError(f"--retry-crashed takes {FLOW_NAME}/<deployment>, e.g. {FLOW_NAME}/llama3-8b; got {deployment!r}")
    return Automation(
        name=RETRY_AUTOMATION_PREFIX + deployment_name,
        description=f"Retries crashed runs of {deployment} (at most RLHF_MAX_CRASH_RETRIES times in a row).",
        trigger=EventTrigger(
            posture=Posture.Reactive,
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related=[
                {"prefect.resource.role": "flow", "prefect.resource.name": FLOW_NAME},
                {"prefect.resource.role": "deployment", "prefect.resource.name": deployment_name},
            ],
            threshold=1,
            within=timedelta(0),
        ),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry", message=AUTO_RETRY_MESSAGE)],
    )


def _save(automation: Automation) -> str:
    try:
        existing = Automation.read(name=automation.name)
    except ValueError:  # Automation.read raises ValueError when no automation has that name
        automation.create()
        return f"created automation {automation.name}"
    automation.id = existing.id
    automation.update()
    return f"updated automation {automation.name}"


def job_template() -> dict:
    """Prefect's process template with the command (None: the worker's own `python -m prefect.engine`), the
    environment and the working directory (None: the deployment's pull step sets it) written into the job
    configuration; the variables left (name, labels, stream_output) cannot change what runs, and the server refuses
    any other job variable (additionalProperties false) of a deployment or a run."""
    from prefect.workers.process import ProcessWorker

    template = ProcessWorker.get_default_base_job_template()
    template["job_configuration"].update(command=None, env=dict(FLOW_RUN_ENV), working_dir=None)
    variables = template["variables"]
    for fixed in ("command", "env", "working_dir"):
        variables["properties"].pop(fixed)
    variables["additionalProperties"] = False
    return template


def ensure_work_pool(name: str = WORK_POOL) -> str:
    """The pool, created with `job_template()`; an existing pool (made by hand with Prefect's default template, or
    changed since) has its template set back."""
    template = job_template()
    with get_client(sync_client=True) as client:
        try:
            pool = client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
            return f"created work pool {name}"
        if pool.base_job_template == template:
            return f"work pool {name} exists"
        client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))
        return f"work pool {name}: base job template set (command, env and working_dir fixed, no other job variable)"


def setup_server(retry_crashed: list[str] = ()) -> list[str]:
    """Create or update the work pool and automations; returns what was done, one line each."""
    # Built first: a bad deployment name is reported before anything on the server changes.
    automations = [zombie_automation(get_settings().zombie_after_s),
                   *(retry_crashed_automation(deployment) for deployment in retry_crashed)]
    return [ensure_work_pool(), *(_save(automation) for automation in automations)]


def deploy_step(retry_crashed: list[str] | None = None) -> dict:
    """`prefect deploy` build step (prefect.yaml): the same setup, for every deploy."""
    return {"setup": setup_server(retry_crashed or [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.server_setup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--retry-crashed", action="append", default=[], metavar="DEPLOYMENT",
                        help=f"retry crashed runs of this deployment automatically, e.g. {FLOW_NAME}/llama3-8b")
    args = parser.parse_args(argv)
    try:
        for line in setup_server(args.retry_crashed):
            print(line)
    except ValueError as error:
        parser.error(str(error))
    return 0


if __name__ == "__main__":
    sys.exit(main())
