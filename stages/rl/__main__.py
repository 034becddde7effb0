"""`python -m stages.rl` (also `deepspeed --module stages.rl` and a Ray job's entrypoint)."""

from stages.launch import stage_main
from stages.rl.config import RLConfig
from stages.rl.driver import run

stage_main(RLConfig, run)
