"""`python -m stages.evaluate` (also `deepspeed --module stages.evaluate` and a Ray job's entrypoint)."""

from stages.evaluate.config import EvaluateConfig
from stages.evaluate.run import run
from stages.launch import stage_main

stage_main(EvaluateConfig, run)
