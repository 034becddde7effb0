"""The evaluation report in the Prefect UI (pipeline/report.py renders it).

The curve is drawn from the policy artifact's history.json and committed, with the report's markdown, as a version
of the `report` stage (inputs: the evaluation and the policy), so it is as immutable and checksummed as the rest; a
re-run with the same evaluation and policy finds that version instead of committing another. The sample answers
come from the evaluation's samples.jsonl; both are read through the store's checked path. In the UI the curve is
the PNG itself, embedded in the markdown.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.artifacts import ArtifactError, InputRef, open_store
from infra.secrets import Redactor
from pipeline.identity import StageResult
from pipeline.report import CURVE_FILE, ReportResult, learning_curve_png, png_data_uri, report_markdown
from tasks.run_stage import artifact_key

REPORT_STAGE = "report"
SAMPLES_FILE = "samples.jsonl"


def _report_key(report: StageResult, policy: StageResult) -> str:
    return hashlib.sha256(json.dumps({"evaluate": report.digest, "policy": policy.digest}).encode()).hexdigest()


# Files of a job's output the worker parses, read only below these sizes (the evaluation keeps a few answers per
# prompt; a history is a few hundred numbers a step).
MAX_SAMPLES_BYTES = 256 * 2**20
MAX_HISTORY_BYTES = 64 * 2**20


@task(name="publish-report", persist_result=True)
def publish_report(report: StageResult, policy: StageResult, *, artifact_root: str) -> ReportResult:
    """Commit the report (markdown + learning curve) to the store and show it as a Prefect markdown artifact."""
    logger = get_run_logger()
    redact = Redactor()
    store = open_store(artifact_root, report.pipeline, log=logger.warning)
    evaluation = store.get(report.stage, report.version)
    samples = ([json.loads(line) for line in store.read_file(evaluation, SAMPLES_FILE, MAX_SAMPLES_BYTES)
                .decode().splitlines()] if SAMPLES_FILE in evaluation.files else [])
    key = _report_key(report, policy)
    committed = store.find_by_stage_key(REPORT_STAGE, key)
    if committed is None:
        policy_store = open_store(artifact_root, policy.pipeline, log=logger.warning)
        policy_manifest = policy_store.get(policy.stage, policy.version)
        try:
            history = json.loads(policy_store.read_file(policy_manifest, "history.json", MAX_HISTORY_BYTES))
        except ArtifactError:  # a policy without history.json (or one too large to read): the report has no curve
            history = []
        png = learning_curve_png(history, f"{policy.pipeline}/{policy.stage} v{policy.version}")
        with tempfile.TemporaryDirectory() as tmp:
            if png is not None:
                (Path(tmp) / CURVE_FILE).write_bytes(png)
            # In the stored copy the curve is linked relative to report.md, wherever the version is read from.
            stored = report_markdown(report, policy, CURVE_FILE if png else None, samples)
            (Path(tmp) / "report.md").write_text(redact.text(stored))
            committed = store.commit(
                REPORT_STAGE, tmp, config={"evaluate": report.uri, "policy": policy.uri},
                inputs={"evaluate": InputRef(uri=report.uri, digest=report.digest),
                        "policy": InputRef(uri=policy.uri, digest=policy.digest)},
                metrics=redact.data(report.metrics), stage_key=key,
            )  # fmt: skip
    curve_uri = f"{committed.uri}/{CURVE_FILE}" if CURVE_FILE in committed.files else None
    curve = png_data_uri(store.read_file(committed, CURVE_FILE)) if curve_uri else None
    shown = redact.text(report_markdown(report, policy, curve, samples))
    artifact_id = create_markdown_artifact(key=artifact_key(report.pipeline, "evaluation-report"), markdown=shown,
                                           description=f"evaluation report, {REPORT_STAGE} v{committed.version}")
    logger.info(f"evaluation report {REPORT_STAGE} v{committed.version} at {committed.uri}")
    # The result keeps the stored markdown (the curve linked, not embedded): results stay small.
    return ReportResult(uri=committed.uri, version=committed.version, curve_uri=curve_uri,
                        markdown=store.read_file(committed, "report.md").decode(), artifact_id=str(artifact_id))
