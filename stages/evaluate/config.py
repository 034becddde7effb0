"""The evaluation stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from stages.config import PolicyPath, PromptConfig, RankLayout, max_samples_field
from stages.fields import Dataset


class EvaluateConfig(RankLayout, PromptConfig):
    """Held-out evaluation of a policy against its reference (and the production policy): `python -m stages.evaluate`.

    Every model answers the prompts through the rollout engines: greedy answers (accuracy with a reward function,
    mean reward-model score) and --eval_n_samples_per_prompt samples (pass@n); the policy's KL to the reference is
    estimated on its own samples. Writes metrics.json and samples.jsonl.
    """

    stage = "evaluate"
    tiny_rows = "prompts"
    tiny_assets = {"ref_pretrain": "model", "prompt_data": "prompts_eval", "remote_rm_url": "rule_reward"}
    rank_flags = "vllm_num_engines × vllm_tensor_parallel_size, num_gpus_per_node"

    # What the promotion gate judges on is the deployment's alone: a run that could pick the seed or shrink the
    # prompt set could retry until noise passes a candidate. Redeclared here without RUN_OVERRIDE.
    seed: int = Field(42, description="random seed of the sampled answers (pass@n, KL); set by the deployment only")
    max_samples: int = max_samples_field(1_000_000)
    pretrain: PolicyPath = Field(None, description="policy to evaluate (HF dir, hub name or s3:// URI)")
    prompt_data: Annotated[str | None, Dataset(split="prompt_split", held_out=True)] = Field(
        None, description="held-out prompts: hub name, local json/jsonl/parquet or s3:// URI",
    )
    ref_pretrain: PolicyPath = Field(
        None, description="reference policy to compare with (KL, reward gain, accuracy); unset: no comparison",
    )
    production_pretrain: PolicyPath = Field(
        None, description="the policy in production, scored on the same prompts (production_* metrics); unset: none",
    )
    num_gpus_per_node: int = Field(
        8, ge=1, description="ranks per node of the reward model that scores responses (with --reward_pretrain)",
    )
    micro_rollout_batch_size: int = Field(16, ge=1, description="sequences per reward-model forward on one rank")
