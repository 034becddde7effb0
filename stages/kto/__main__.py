"""`python -m stages.kto` (also `deepspeed --module stages.kto` and a Ray job's entrypoint)."""

from stages.kto.config import KTOConfig
from stages.kto.train import run
from stages.launch import stage_main

stage_main(KTOConfig, run)
