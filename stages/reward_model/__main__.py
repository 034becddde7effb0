"""`python -m stages.reward_model` (also `deepspeed --module stages.reward_model` and a Ray job's entrypoint)."""

from stages.launch import stage_main
from stages.reward_model.config import RewardModelConfig
from stages.reward_model.train import run

stage_main(RewardModelConfig, run)
