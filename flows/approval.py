"""A person's approval before a candidate becomes `production` (`gate.require_approval` in the preset).

The flow run pauses with Prefect's pause-with-input: the run's page in the UI shows a form (approve or reject, a
comment) with the evaluation report linked; resuming it there, or from the command line, answers it:

    python -m flows.approval <flow-run-id> [--reject] [--comment "why"]

No answer within `gate.approval_timeout_s` rejects the candidate, and the run goes on to its end (production
unchanged). The answer becomes part of the promotion decision (`approval`).
"""

from __future__ import annotations

import argparse
import sys
import threading
from uuid import UUID

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import get_run_context
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from prefect.settings import PREFECT_UI_URL
from prefect.states import Running
from pydantic import Field

from pipeline.config import PromotionGate
from pipeline.gate import PromotionDecision, decision_markdown
from pipeline.report import ReportResult
from tasks.run_stage import artifact_key

POLL_S = 5
PAUSE_MARGIN_S = 3600  # how much later than the run's own deadline the server's pause timeout falls


class Approval(RunInput):
    """The form a paused run shows."""

    approve: bool = Field(description="promote the candidate to production")
    comment: str = Field("", description="why (kept with the decision)")


class Deadline(threading.Thread):
    """Answers the paused run's form with a rejection once `timeout_s` passed without a person's answer (resumed
    through Prefect's own API, as `python -m flows.approval --reject` does); tried again until it lands or stop()."""

    def __init__(self, flow_run_id: UUID, timeout_s: float, why: str):
        super().__init__(name="approval-deadline", daemon=True)
        self.flow_run_id, self.timeout_s, self.why = flow_run_id, timeout_s, why
        self.answered = False
        self._stopped = threading.Event()

    def run(self) -> None:
        if self._stopped.wait(self.timeout_s):
            return
        while not self._stopped.is_set():
            try:
                resume_flow_run(self.flow_run_id, run_input={"approve": False, "comment": self.why})
                self.answered = True
                return
            except Exception:  # noqa: BLE001 - not paused yet, or the server away for a moment: try again
                self._stopped.wait(POLL_S)

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=30)


def report_link(report: ReportResult) -> str:
    """The report's page in the Prefect UI (relative to the UI when its address is not configured)."""
    ui = (PREFECT_UI_URL.value() or "").rstrip("/")
    return f"{ui}/artifacts/artifact/{report.artifact_id}" if report.artifact_id else report.uri


def approval_request(decision: PromotionDecision, report: ReportResult, gate: PromotionGate) -> str:
    """The form's description: what would be promoted, the gate's numbers, the report."""
    return (f"## Approve {decision.stage} v{decision.version} for production?\n\n"
            f"It passed the gate. Read the [evaluation report]({report_link(report)}) (held-out answers of the "
            f"candidate, its reference and production), then set **approve** and submit. Without an answer within "
            f"{gate.approval_timeout_s:.0f} s it is rejected.\n\n{decision_markdown(decision, report.uri)}")


def await_approval(decision: PromotionDecision, report: ReportResult, gate: PromotionGate) -> PromotionDecision:
    """Pause the flow run until a person answers the form; the decision as they answered, rejected on timeout."""
    logger = get_run_logger()
    # One pause per candidate and baseline: a retried run that was answered before gets the same answer.
    key = artifact_key("approve", decision.stage, f"v{decision.version}", "over", str(decision.production_version))
    form = Approval.with_initial_data(description=approval_request(decision, report, gate), approve=False)
    logger.info(f"waiting up to {gate.approval_timeout_s:.0f} s for a person to approve {decision.stage} "
                f"v{decision.version} (the run's page in the UI, or python -m flows.approval <flow-run-id>)")
    why = f"no approval within {gate.approval_timeout_s:.0f} s: rejected"
    deadline = Deadline(get_run_context().flow_run.id, gate.approval_timeout_s, why)
    deadline.start()
    try:
        # The server fails a pause that outlives its timeout (and refuses to resume it): the run's own deadline
        # answers first, so the run never shows a failure for what is a rejection.
        answer = pause_flow_run(wait_for_input=form, timeout=int(gate.approval_timeout_s) + PAUSE_MARGIN_S, key=key,
                                poll_interval=POLL_S)
    except FlowPauseTimeout:  # the deadline's answer never landed (the server unreachable for the whole margin)
        with get_client(sync_client=True) as client:  # back to Running, so that the rest of the run can end it
            client.set_flow_run_state(get_run_context().flow_run.id, Running(message=why), force=True)
        answer = None
    finally:
        deadline.stop()
    if answer is None or (deadline.answered and not answer.approve):
        logger.warning(f"{decision.stage} v{decision.version}: {why}")
        return decision.rejected(why).model_copy(update={"approval": why})
    said = f"{'approved' if answer.approve else 'rejected'}" + (f": {answer.comment}" if answer.comment else "")
    logger.info(f"{decision.stage} v{decision.version} {said}")
    decided = decision if answer.approve else decision.rejected(f"a person {said}")
    return decided.model_copy(update={"approval": said})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.approval",
                                     description="Answer a full-rlhf run that waits for approval before promoting.")
    parser.add_argument("flow_run_id", type=UUID, help="the paused flow run (its page in the UI shows the id)")
    parser.add_argument("--reject", action="store_true", help="reject the candidate (default: approve it)")
    parser.add_argument("--comment", default="", help="why, kept with the decision")
    args = parser.parse_args(argv)
    resume_flow_run(args.flow_run_id, run_input={"approve": not args.reject, "comment": args.comment})
    print(f"{'rejected' if args.reject else 'approved'}: flow run {args.flow_run_id} resumes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
