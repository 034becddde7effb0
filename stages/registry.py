"""Every stage by name: its config class, which is also its descriptor (what it reads, what it trains, where its
ranks go). For the pipeline, the plan and the tests; no stage's own code imports this module, so a stage's code
version covers its own config, not the others'."""

from __future__ import annotations

from stages.config import STAGE_NAMES, OfflineTrainingConfig, StageConfig
from stages.dpo.config import DPOConfig
from stages.evaluate.config import EvaluateConfig
from stages.kto.config import KTOConfig
from stages.reward_model.config import RewardModelConfig
from stages.rl.config import RLConfig
from stages.sft.config import SFTConfig

STAGES: dict[str, type[StageConfig]] = {
    cls.stage: cls for cls in (SFTConfig, RewardModelConfig, DPOConfig, KTOConfig, RLConfig, EvaluateConfig)
}
assert tuple(STAGES) == STAGE_NAMES, "stages.config.STAGE_NAMES lists the stages in pipeline order"

# The stages that train on a fixed dataset, as opposed to RL and the evaluation, which read prompts.
OFFLINE_STAGES = tuple(stage for stage, cls in STAGES.items() if issubclass(cls, OfflineTrainingConfig))
