"""`python -m stages.dpo` (also `deepspeed --module stages.dpo` and a Ray job's entrypoint)."""

from stages.dpo.config import DPOConfig
from stages.dpo.train import run
from stages.launch import stage_main

stage_main(DPOConfig, run)
