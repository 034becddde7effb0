"""What a full-rlhf run returns.

Kept out of flows/full_rlhf.py on purpose: workers and `prefect flow-run retry` load that file by path, as a
module named `full_rlhf`, and a persisted (pickled) result must name a class importable everywhere.
"""

from __future__ import annotations

from pydantic import BaseModel

from pipeline.gate import PromotionDecision
from pipeline.identity import StageResult
from pipeline.report import ReportResult


class PipelineResult(BaseModel):
    """What one run produced: the committed artifact of every stage of its shape (each `reused` or trained), the
    promotion decision with the numbers it was taken on, and the report."""

    artifact_root: str
    shape: str
    stages: dict[str, StageResult]
    promotion: PromotionDecision
    report: ReportResult
    unchanged: bool  # every stage was reused: no job ran
