"""`python -m stages.sft` (also `deepspeed --module stages.sft` and a Ray job's entrypoint)."""

from stages.launch import stage_main
from stages.sft.config import SFTConfig
from stages.sft.train import run

stage_main(SFTConfig, run)
