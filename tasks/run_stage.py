"""The Prefect task that runs one pipeline stage as a Ray job and commits its output as an artifact.

One call: resolve the stage config (each input artifact's URI goes into the config field it feeds), derive the
stage key, return the committed artifact if one with that key exists, else submit (or re-attach to) the Ray job
`python -m stages.<stage> --config <workspace>/config.yaml --save_path <workspace>/output [--ckpt_path
<workspace>/ckpt]`, stream its log into the Prefect log (secrets redacted, step lines moving a progress
artifact), watch it against a deadline, and commit `output/`.

The stage key (pipeline/identity.py) covers the stage config, the digests of its input artifacts, a fingerprint of
the content of every dataset it reads and the code its job runs: new data at the same path retrains the stage, and
with it every stage after it; nothing changed, nothing runs. The workspace
`<workspace_root>/<pipeline>/<stage>/<stage_key[:16]>/` depends only on the stage key, so every attempt of the same
stage, in this flow run or a retried one, finds the checkpoints of the last.
"""

from __future__ import annotations

import asyncio
import queue
import re
import shlex
import shutil
import threading
import time
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_table_artifact
from prefect.context import get_run_context
from pydantic import BaseModel

from infra.artifacts import (ArtifactError, ChecksumError, InputRef, StoreUnreachable, holds_files_of, open_store,
                             read_metrics)
from infra.ray_cluster import RayClusterError, job_client
from infra.secrets import Redactor
from infra.settings import Settings, get_settings
from pipeline.identity import StageResult, stage_code_version, stage_identity
from stages.errors import EXIT_CONFIG_ERROR
from stages.launch import writer_lock_holder, writer_lock_path
from tasks.progress import StageProgress
from tasks.results import persisted

TERMINAL_STATUSES = {"SUCCEEDED", "FAILED", "STOPPED"}
# Ray colours the "(Worker pid=...)" prefixes of actor output; the Prefect log wants plain text.
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class StageError(RuntimeError):
    """A stage job did not produce its output; `retryable` says whether another attempt can help."""

    retryable = True


class StageConfigError(StageError):
    """The stage rejected its config or data (exit code 2): the same inputs fail the same way."""

    retryable = False


class StageStopped(StageError):
    """The job was stopped from outside (dashboard, `ray job stop`): someone meant it."""

    retryable = False


class StageTimeout(StageError):
    """The job passed its deadline and was stopped; a retry resumes from the last checkpoint."""


def retry_only_fixable(task, task_run, state) -> bool:
    """Prefect retry condition: retry infrastructure failures, never config/data errors."""
    error = state.result(raise_on_failure=False)
    return not isinstance(error, StageError) or error.retryable


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key: only lowercase letters, digits and dashes are allowed."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def _job_info(client, submission_id: str):
    """The job's info, or None if no job with that submission id exists."""
    try:
        return client.get_job_info(submission_id)
    except RuntimeError as err:
        if "status code 404" in str(err):
            return None
        raise


def _latest_attempt(client, key: str) -> tuple[int, Any]:
    """(number, info) of the newest job attempt for this stage key; (0, None) when there is none."""
    attempt, info = 0, None
    while (next_info := _job_info(client, submission_id(key, attempt + 1))) is not None:
        attempt, info = attempt + 1, next_info
    return attempt, info


def submission_id(key: str, attempt: int) -> str:
    """Ray submission ids cannot be reused: one per (stage key, attempt)."""
    return f"rlhf-{key[:16]}-{attempt}"


class _LogForwarder:
    """Copies the new part of a job's log into the Prefect log, whole lines only, secrets redacted; hands the
    new lines to the stage's progress artifact.

    The log arrives incrementally through Ray's log tail (a websocket, followed in a thread of its own); only at the
    end, to be sure nothing is missing, or when the tail breaks off, is the whole log fetched (Ray's HTTP API has no
    offsets)."""

    def __init__(self, client, job_id: str, logger, redact: Redactor, progress: StageProgress):
        self.client, self.job_id, self.logger = client, job_id, logger
        self.redact, self.progress = redact, progress
        self.offset = 0
        self.text = ""
        self._chunks: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._tail_broke = threading.Event()
        threading.Thread(target=self._follow, name=f"log tail of {job_id}", daemon=True).start()

    def _follow(self) -> None:
        async def follow() -> None:
            async for chunk in self.client.tail_job_logs(self.job_id):
                self._chunks.put(chunk)

        try:
            asyncio.run(follow())
        except Exception:  # the websocket failed or closed early: polls fetch the whole log instead
            self._tail_broke.set()

    def _received(self) -> str:
        chunks = []
        while not self._chunks.empty():
            chunks.append(self._chunks.get())
        return ANSI_ESCAPE.sub("", "".join(chunks))

    def forward(self, final: bool = False) -> None:
        if final or self._tail_broke.is_set():
            self.text = ANSI_ESCAPE.sub("", self.client.get_job_logs(self.job_id))
        else:
            self.text += self._received()
        new = self.text[self.offset :]
        if not final:
            new = new[: new.rfind("\n") + 1]
        lines = new.splitlines()
        for line in lines:
            self.logger.info(self.redact.text(line))
        self.offset += len(new)
        self.progress.update(lines)

    def tail(self, lines: int = 30) -> str:
        return self.redact.text("\n".join(self.text.splitlines()[-lines:]))


def _watch(client, address: str, job_id: str, deadline_s: float, poll_s: float, logger,
           logs: _LogForwarder) -> tuple[Any, str]:  # fmt: skip
    """Follow the job to a terminal state; returns (info, log tail). Stops the job on deadline or cancel."""
    started = time.monotonic()
    try:
        while True:
            try:
                info = client.get_job_info(job_id)
                logs.forward()
            except OSError as err:  # requests' connection errors are OSErrors
                raise RayClusterError(
                    f"lost the Ray cluster at {address} while watching job {job_id}: {err}"
                ) from err
            if info.status.value in TERMINAL_STATUSES:
                logs.forward(final=True)
                return info, logs.tail()
            if time.monotonic() - started > deadline_s:
                logger.error(f"job {job_id} passed its deadline of {deadline_s:.0f}s; stopping it")
                client.stop_job(job_id)
                raise StageTimeout(f"job {job_id} ran longer than {deadline_s:.0f}s and was stopped")
            time.sleep(poll_s)
    except (StageTimeout, RayClusterError):
        raise
    except BaseException:
        # Cancellation, worker shutdown (SIGTERM becomes an exception here) or a lost connection:
        # don't leave the job running unwatched.
        logger.warning(f"stopping job {job_id}: its watcher is going away")
        try:
            client.stop_job(job_id)
        except Exception as err:  # the cluster may be what went away
            logger.warning(f"could not stop job {job_id}: {err}")
        raise


def _raise_for_failure(stage: str, job_id: str, info, log_tail: str, redact: Redactor) -> None:
    status = info.status.value
    if status == "STOPPED":
        raise StageStopped(f"stage {stage}: job {job_id} was stopped from outside\n{log_tail}")
    exit_code = info.driver_exit_code
    if exit_code == EXIT_CONFIG_ERROR:
        raise StageConfigError(f"stage {stage}: config or data error (job {job_id}, exit 2):\n{log_tail}")
    # Ray's message repeats the log; its first line says what happened (node died, supervisor lost, ...).
    reason = (info.message or "").split("\n", 1)[0] or (info.error_type.value if info.error_type else "unknown")
    raise StageError(redact.text(f"stage {stage}: job {job_id} failed, exit code {exit_code}: {reason}\n{log_tail}"))


def _publish(result: StageResult, logger) -> None:
    """Prefect UI artifacts: a link to the committed version and a table of its metrics."""
    create_link_artifact(
        key=artifact_key(result.pipeline, result.stage),
        link=result.uri,
        link_text=f"{result.pipeline}/{result.stage} v{result.version}",
        description=f"digest `{result.digest[:16]}`, stage key `{result.stage_key[:16]}`",
    )
    if result.metrics:
        create_table_artifact(
            key=artifact_key(result.pipeline, result.stage, "metrics"),
            table=[{"metric": name, "value": value} for name, value in sorted(result.metrics.items())],
            description=f"{result.stage} v{result.version} metrics",
        )
    logger.info(f"committed {result.stage} v{result.version} at {result.uri}")


def _flow_run_id() -> str:
    context = get_run_context()
    task_run = getattr(context, "task_run", None)
    return str(task_run.flow_run_id) if task_run and task_run.flow_run_id else ""


@task(name="run-stage", task_run_name="{stage}", persist_result=True, retry_condition_fn=retry_only_fixable)
def run_stage(
    stage: str,
    config: BaseModel | dict,
    inputs: dict[str, StageResult] | None = None,
    *,
    pipeline: str,
    artifact_root: str,
    deadline_s: float | None = None,
) -> StageResult:
    """Run `stage` with `config` on `inputs` (config field -> upstream result) as a Ray job; return its artifact."""
    settings = get_settings()
    logger = get_run_logger()
    redact = Redactor()
    inputs = inputs or {}
    code = stage_code_version(settings, stage)
    identity = stage_identity(pipeline, stage, config, inputs, code)
    key, resolved = identity.key, identity.config
    store = open_store(artifact_root, pipeline, log=logger.warning)

    damaged = None
    while (existing := store.find_by_stage_key(stage, key)) is not None:
        try:
            store.verify_for_reuse(existing)
        except ChecksumError as damage:  # reused as it is, it would fail the next stage on every night
            store.quarantine(stage, existing.version, str(damage))
            logger.warning(f"{stage}: committed v{existing.version} is damaged ({damage}); quarantined, the stage "
                           "is built again")
            damaged = existing
            continue
        logger.info(f"{stage}: reusing committed v{existing.version} ({existing.uri}): config, inputs, data and "
                    f"code unchanged (stage key {key[:16]})")
        return StageResult.from_manifest(existing, reused=True)
    for field, ref in identity.datasets.items():
        logger.info(f"{stage}: {field} {ref.source} has fingerprint {ref.fingerprint}")

    workspace = settings.workspace_root / pipeline / stage / key[:16]
    output_dir, ckpt_dir = workspace / "output", workspace / "ckpt"
    resolved["save_path"] = str(output_dir)
    checkpoints = "ckpt_path" in resolved  # evaluation has no checkpoints
    if checkpoints:
        resolved["ckpt_path"] = str(ckpt_dir)
    config_path = workspace / "config.yaml"
    if damaged is not None and (output_dir / "metrics.json").exists() and not holds_files_of(output_dir, damaged):
        # The job's output is committed again below only if it is what the damaged version held when committed.
        shutil.rmtree(output_dir)

    if not settings.ray_address:
        raise RayClusterError("no Ray cluster: set RLHF_RAY_ADDRESS (the full-rlhf flow sets it for a local head)")
    client = job_client(settings.ray_address, settings)

    attempt, info = _latest_attempt(client, key)
    if info is not None and info.status.value not in TERMINAL_STATUSES:
        job_id = submission_id(key, attempt)
        logger.info(f"{stage}: re-attaching to job {job_id} ({info.status.value})")
    elif info is not None and info.status.value == "SUCCEEDED" and (output_dir / "metrics.json").exists():
        job_id = submission_id(key, attempt)
        logger.info(f"{stage}: job {job_id} already succeeded; committing its output")
    else:
        job_id = submission_id(key, attempt + 1)
        writer = writer_lock_holder(writer_lock_path(str(output_dir), str(ckpt_dir) if checkpoints else None))
        if writer is not None:  # e.g. a job of a lost Ray head that still runs: never two writers
            raise StageError(f"stage {stage}: workspace {workspace} is still being written by {writer}; "
                             "retry when it has finished")
        shutil.rmtree(output_dir, ignore_errors=True)  # a half-written output of a failed attempt
        output_dir.mkdir(parents=True, exist_ok=True)
        if checkpoints:
            ckpt_dir.mkdir(exist_ok=True)
        config_path.write_text(yaml.safe_dump(resolved, sort_keys=False))
        module = f"{settings.stage_module_prefix}.{stage}"
        command = [settings.job_python, "-m", module, "--config", str(config_path), "--save_path", str(output_dir)]
        entrypoint = shlex.join(command + (["--ckpt_path", str(ckpt_dir)] if checkpoints else []))
        client.submit_job(
            entrypoint=entrypoint,
            submission_id=job_id,
            runtime_env=settings.job_runtime_env(),
            metadata={"pipeline": pipeline, "stage": stage, "stage_key": key, "attempt": str(attempt + 1),
                      "flow_run_id": _flow_run_id()},
        )  # fmt: skip
        resumed = checkpoints and any(ckpt_dir.iterdir())
        logger.info(f"{stage}: submitted job {job_id} ({entrypoint}){'; checkpoints present' if resumed else ''}")

    progress = StageProgress(artifact_key(pipeline, stage, "progress"), stage)
    logs = _LogForwarder(client, job_id, logger, redact, progress)
    deadline = deadline_s or settings.stage_deadline_s
    info, log_tail = _watch(client, settings.ray_address, job_id, deadline, settings.poll_interval_s, logger, logs)
    if info.status.value != "SUCCEEDED":
        _raise_for_failure(stage, job_id, info, log_tail, redact)
    # A concurrent run with the same stage key may have committed first: use its version.
    existing = store.find_by_stage_key(stage, key)
    if existing is not None:
        return StageResult.from_manifest(existing)
    try:
        metrics = read_metrics(output_dir)
        manifest = store.commit(
            stage,
            output_dir,
            config=redact.data(resolved),
            inputs={field: InputRef(uri=r.uri, digest=r.digest) for field, r in inputs.items()},
            datasets=identity.datasets,
            code_version=code,
            metrics=redact.data(metrics),
            stage_key=key,
        )
    except StoreUnreachable:
        raise  # the output is fine: a retry commits it
    except ArtifactError as error:
        # The job succeeded but wrote what cannot be committed (non-finite metrics, a bad file name): re-attaching
        # to it would refuse the same output forever. Set it aside; the retry finds no output and runs a new job.
        refused = workspace / f"refused-{job_id}"
        output_dir.rename(refused)
        _drop_older_refused(workspace)
        raise StageError(redact.text(f"stage {stage}: the output of job {job_id} cannot be committed: {error}; set "
                                     f"aside in {refused}, a retry runs the stage again as a new job")) from error
    progress.finish(metrics.get("steps") if isinstance(metrics.get("steps"), int) else None)
    result = StageResult.from_manifest(manifest)
    _publish(result, logger)
    return result


# Set-aside outputs kept for a look, the newest first: a refusal that repeats on every attempt would otherwise keep a
# model per attempt until the disk fills.
KEEP_REFUSED = 2


def _drop_older_refused(workspace: Path) -> None:
    refused = sorted(workspace.glob("refused-*"), key=lambda path: path.stat().st_mtime, reverse=True)
    for path in refused[KEEP_REFUSED:]:
        shutil.rmtree(path, ignore_errors=True)


def stage_task(settings: Settings | None = None):
    """`run_stage` with retries and (checked, JSON) result storage taken from the current settings."""
    settings = settings or get_settings()
    return run_stage.with_options(retries=settings.max_retries, retry_delay_seconds=settings.retry_delay_s,
                                  **persisted(settings))
