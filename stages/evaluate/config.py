"""The evaluation stage's config: its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from stages.config import PolicyPath, PromptConfig, RankLayout, RolloutBackend, max_samples_field
from stages.evaluate.suite import Benchmark, load_suite, suite_problems
from stages.fields import NOT_TRAINING, REWARD_SOURCE, Dataset, FileValued


class EvaluateConfig(RankLayout, PromptConfig):
    """Held-out evaluation of a policy against its reference (and the production policy): `python -m stages.evaluate`.

    Every model answers the prompts through the rollout engines: greedy answers (accuracy with a reward function,
    mean reward-model score) and --eval_n_samples_per_prompt samples (pass@n); the policy's KL to the reference is
    estimated on its own samples. With --eval_suite every model also answers each benchmark of the suite
    (stages/evaluate/suite.py), its metrics prefixed with the benchmark's name. Writes metrics.json and samples.jsonl.
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
    rollout_backend: RolloutBackend = Field(
        "auto", description="generation engine: vllm, hf (transformers generate), or auto (vllm when installed); "
        "the deployment's alone: another engine is another draw of the sampled metrics the gate judges",
    )
    eval_suite: Annotated[list[Benchmark] | None, FileValued()] = Field(
        None, description="benchmarks every model also answers: a YAML file (a list, or a `benchmarks:` list; read "
        "from a command line or a preset file, never from a run's parameters) or the list itself; each with name, "
        "dataset, split, format (gsm8k, math, prompts, preference_prompts), n_samples, max_samples",
    )

    logprob_gap_samples: Annotated[int, NOT_TRAINING] = Field(
        32, ge=0,
        description="of the policy's samples at temperature 1, how many the policy also scores as the trainer does "
        "(transformers, after the vLLM engines are done): logprob_gap_mean and logprob_gap_max, the engines' "
        "log-probs against it (nats per token); 0: not measured. vLLM engines with tensor parallelism 1 only",
    )
    lm_eval: list[str] | None = Field(
        None, description="lm-evaluation-harness tasks or groups every model also runs through the stage's engines "
        "(the lm_eval extra), e.g. gsm8k ifeval (or gsm8k,ifeval); metrics lm_eval/<task>/<metric> "
        "(stages/evaluate/harness.py)",
    )
    lm_eval_include_path: Annotated[str | None, REWARD_SOURCE] = Field(
        None, description="a folder of lm-eval task YAML files (tasks on local data, say) found besides lm-eval's "
        "own; code, like a reward file (a task's `!function` runs Python from it): its files are in the stage key and "
        "the plan takes it only from where reward files may come",
    )

    required_inputs = (("pretrain",), ("prompt_data", "eval_suite"),
                       ("reward_pretrain", "remote_rm_url", "agent_func_path"))

    def missing_inputs(self) -> list[str]:
        # A preset's benchmark may leave its dataset to the tiny assets of a pipeline; a run by hand names it.
        unset = [benchmark.name for benchmark in self.eval_suite or [] if benchmark.dataset is None]
        return super().missing_inputs() + ([f"the dataset of eval_suite benchmark(s) {', '.join(unset)} (a tiny "
                                            "pipeline fills it in; --eval_suite none evaluates without the suite)"]
                                           if unset else [])

    @field_validator("eval_suite", mode="before")
    @classmethod
    def _read_suite_file(cls, value):
        return load_suite(value)

    @field_validator("lm_eval", mode="before")
    @classmethod
    def _split_task_lists(cls, value):
        # lm-eval's own command line takes `--tasks a,b`: the same words here.
        if isinstance(value, str):
            value = [value]
        return [task for item in value for task in str(item).split(",") if task] if value is not None else None

    @model_validator(mode="after")
    def _check_suite(self):
        problems = suite_problems(self.eval_suite or [])
        if problems:
            raise ValueError(f"--eval_suite: {'; '.join(problems)}")
        return self
