"""Held-out evaluation of a policy against its reference (and the production policy), through the rollout engines.

Each model answers the held-out prompts with the same engines RL samples with (vLLM where installed), in the
models' dtype: greedy answers, scored by the reward function (accuracy with a 0/1 rule reward) and by the reward
model on the very token ids generated, and `--eval_n_samples_per_prompt` samples at `--eval_temperature` for pass@n.
The policy's KL to the reference is estimated on the policy's own samples at temperature 1: the sum over response
tokens of log π − log π_ref (the reference's log-probs are teacher-forced through its engine), averaged over prompts.
Models of the same architecture are swapped into the running engines instead of starting new ones.

Metrics: `accuracy`, `pass1`, `pass<n>`, `maj<n>`, `reward_mean`, `response_length`, `truncated_fraction` for the
policy, the same with a `reference_` / `production_` prefix for the others, and `kl_mean`. The policy against each other
model on the same prompts: `accuracy_gain_vs_<model>`, `reward_gain_vs_<model>` and `win_rate_vs_<model>` (the
reward model's, ties half), each with the bounds of its 95% interval, `_low` and `_high`
(stages/evaluate/algorithms.py). `samples.jsonl` holds the first SAMPLES_SHOWN prompts with each model's greedy
answer and its reward (and reward-model score), for the report.

With `--eval_suite` every model also answers each benchmark of the suite in the same engine start, after the held-out
prompts (stages/evaluate/suite.py): `gsm8k` and `math` answers are compared with their labels by math-verify, with
`extraction_failures` (greedy answers without a final answer) and `maj<n>` (the majority answer of the samples)
beside `pass1` and `pass<n>`; `prompts` answers get the stage's reward; every benchmark's answers get the reward
model's score, and with it the win rates. Its metrics, comparisons and samples carry the prefix `<name>/`. The KL is
estimated on the first prompt set (--prompt_data where given).

The candidate's log-prob gap: of its samples at temperature 1, the first `--logprob_gap_samples` are also scored by
the policy in transformers (the trainer's forward), once the vLLM engines are done; `logprob_gap_mean` and
`logprob_gap_max` are the mean and largest difference per token from the engines' log-probs. A policy saved in a way
vLLM reads otherwise than transformers (a lost tie, a config field one of them ignores) shows there.

With `--lm_eval` every model also runs lm-evaluation-harness tasks through the same engines
(stages/evaluate/harness.py): `lm_eval/<task>/<metric>`, `reference_` / `production_` before the metric for the
others.

With `--agent_func_path` each model plays the agent's episodes instead (greedy, and sampled for pass@n): `accuracy`
is the mean episode reward, `response_length` counts the episode's tokens after the prompt; the KL is still
estimated on single responses.

Every model is scored on every prompt, or the evaluation fails: when reward requests fail (an endpoint down past
its retries), the stage stops with exit 1, to be retried, rather than score the models on different subsets of
the prompts or commit a metric that is not a number.

    python -m stages.evaluate --config tiny --pretrain ./policy --ref_pretrain ./sft --reward_pretrain ./rm \
        --remote_rm_url reward.py --prompt_data prompts_eval.jsonl --save_path ./report
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import ray
import torch
from ray.util.placement_group import placement_group

from stages import data, prepared
from stages import engine as ds
from stages.answers import is_correct, vote_key
from stages.distributed import ActorGroup, Placement, cluster_device, cpu_threads, init_ray
from stages.errors import StageInputError
from stages.evaluate.algorithms import majority_vote, paired_gain, win_rate
from stages.evaluate.suite import MATH_FORMATS, Benchmark, benchmark_rows
from stages.launch import note_limits
from stages.placement import bundle_resources, group_bundles
from stages.rewards import reward_source_of
from stages.rl.agents import agent_rollouts, load_agent_executor
from stages.rl.critic import RewardModelWorker
from stages.rl.rollout import Rollout, create_rollout_engines, generate_across, resolve_backend, score_across
from stages.sequences import build_sequences
from stages.tracking import StepLog

SAMPLES_SHOWN = 4  # prompts of samples.jsonl, answered by every model


class RewardsUnavailable(RuntimeError):
    """Reward requests of the evaluation failed after their retries: scores would not be comparable (exit 1)."""


# What may differ between two models' config.json when one's weights go into an engine built for the other: where
# they were saved from and the dtype they were saved in (the engine's own dtype is --bf16's).
CONFIG_KEYS_AN_ENGINE_IGNORES = {"_name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype"}


def same_architecture(path_a: str, path_b: str) -> bool:
    """Whether one model's weights can be loaded into an engine built for the other: their config files say the
    same in everything the engine reads (shapes, positions, special tokens). Read as saved, without building
    either config class: AutoConfig imports the model family's modeling stack (about 3 CPU-seconds here)."""
    from transformers.configuration_utils import PretrainedConfig

    a, b = ({key: value for key, value in PretrainedConfig.get_config_dict(path)[0].items()
             if key not in CONFIG_KEYS_AN_ENGINE_IGNORES} for path in (path_a, path_b))
    return a == b


@dataclass
class PromptSet:
    """Prompts every model answers, scored one way: --prompt_data (its metrics unprefixed, format "prompts") or one
    benchmark of the suite (its metrics prefixed with `<name>/`)."""

    name: str
    format: str
    prompts: list[dict]
    n_samples: int

    def key(self, metric: str) -> str:
        return f"{self.name}/{metric}" if self.name else metric

    def labels(self, n: int) -> list[str]:
        return [p["label"] for p in self.prompts for _ in range(n)]


class Evaluation:
    """Engines that hold one model at a time, the reward sources, and the prompt sets they all answer."""

    def __init__(self, cfg, prompt_sets: list[PromptSet], tokenizer, reward_group: ActorGroup | None,
                 bundle: dict[str, float]):
        self.cfg, self.prompt_sets, self.tokenizer, self.reward_group = cfg, prompt_sets, tokenizer, reward_group
        self.pad_token_id = tokenizer.pad_token_id
        self.bundle = bundle  # what each engine (each tensor-parallel rank) takes of the cluster
        self.reward_source = reward_source_of(cfg)
        self.agent = load_agent_executor(cfg.agent_func_path) if cfg.agent_func_path else None
        self.engines: list = []
        self.loaded: str | None = None
        self.samples: list[dict] = []
        # (prompt set, model) -> "accuracy"/"reward" -> score of each greedy answer
        self.per_prompt: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def load(self, path: str) -> None:
        """Put the model at `path` into the engines: a weight swap when the architecture allows it."""
        cfg = self.cfg
        if self.engines and same_architecture(self.loaded, path):
            ray.get([engine.update_weights_from_path.remote(path) for engine in self.engines])
        else:
            for engine in self.engines:
                ray.kill(engine)
            self.engines = create_rollout_engines(
                path, backend=cfg.rollout_backend, num_engines=cfg.vllm_num_engines,
                tensor_parallel_size=cfg.vllm_tensor_parallel_size,
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, seed=cfg.seed,
                dtype="bfloat16" if cfg.bf16 else "float32", max_model_len=cfg.prompt_max_len + cfg.generate_max_len,
                enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
                num_cpus=self.bundle["CPU"], num_gpus=self.bundle.get("GPU", 0.0),
                cpu_threads=cpu_threads(cfg.vllm_num_engines),
            )
        self.loaded = path

    def answer(self, prompt_set: PromptSet, model: str, *, n: int, temperature: float,
               seed: int) -> tuple[list[Rollout], torch.Tensor | None]:
        """`n` answers per prompt, in prompt order, and the score of each: the agent's episode reward, the reward
        function's, math-verify's 0/1 against the label; None where the set has no such score (preference_prompts,
        or prompts without a reward function: the reward model judges those)."""
        cfg = self.cfg
        if self.agent is not None and prompt_set.format == "prompts":
            rollouts, rewards = agent_rollouts(
                self.agent, self.engines, self.tokenizer, prompt_set.prompts, n=n, temperature=temperature, top_p=1.0,
                max_new_tokens=cfg.generate_max_len, max_length=cfg.prompt_max_len + cfg.generate_max_len, seed=seed,
                logprobs=False, timeout_s=cfg.agent_timeout)
            return rollouts, rewards.rewards
        rollouts = generate_across(self.engines, [p["prompt"] for p in prompt_set.prompts], seed=seed, n=n,
                                   max_new_tokens=cfg.generate_max_len, temperature=temperature, top_p=1.0)
        labels = prompt_set.labels(n)
        if prompt_set.format in MATH_FORMATS:
            return rollouts, torch.tensor([float(is_correct(r.response_text, label))
                                           for r, label in zip(rollouts, labels)])
        if prompt_set.format == "prompts" and self.reward_source is not None:
            return rollouts, self.rewards(model, rollouts, labels)
        return rollouts, None

    def score(self, name: str, prompt_set: PromptSet) -> dict[str, float]:
        """Metrics of the model in the engines on `prompt_set`, prefixed with `name_` (none for the policy)."""
        cfg = self.cfg
        prefix = "" if name == "policy" else f"{name}_"
        greedy, greedy_scores = self.answer(prompt_set, name, n=1, temperature=0.0, seed=cfg.seed)
        per_prompt = self.per_prompt.setdefault((prompt_set.name, name), {})
        metrics = {
            "response_length": sum(len(r.response_ids) for r in greedy) / len(greedy),
            "truncated_fraction": sum(r.finish_reason == "length" for r in greedy) / len(greedy),
        }
        shown = [{"model": name, "benchmark": prompt_set.name, "prompt": r.prompt, "label": label,
                  "response": r.response_text}
                 for r, label in list(zip(greedy, prompt_set.labels(1)))[:SAMPLES_SHOWN]]
        if prompt_set.format in MATH_FORMATS:
            metrics["extraction_failures"] = sum(vote_key(r.response_text) is None for r in greedy) / len(greedy)
        if greedy_scores is not None:
            metrics["accuracy"] = float(greedy_scores.mean())
            per_prompt["accuracy"] = greedy_scores.float().flatten()
            for sample, reward in zip(shown, greedy_scores.tolist()):
                sample["reward"] = reward
            k = prompt_set.n_samples
            if k:
                sampled, sampled_scores = self.answer(prompt_set, name, n=k, temperature=cfg.eval_temperature,
                                                      seed=cfg.seed + 1)
                sampled_scores = sampled_scores.view(-1, k)
                metrics["pass1"] = float(sampled_scores.mean())
                metrics[f"pass{k}"] = float(sampled_scores.max(dim=1).values.mean())
                if self.agent is None or prompt_set.format != "prompts":  # an episode has no one final answer
                    votes = [[vote_key(r.response_text) for r in sampled[i * k:(i + 1) * k]]
                             for i in range(len(prompt_set.prompts))]
                    metrics[f"maj{k}"] = float(majority_vote(votes, sampled_scores).mean())
        if self.reward_group is not None:
            batch = build_sequences([r.prompt_ids for r in greedy], [list(r.response_ids) for r in greedy],
                                    self.pad_token_id)
            scores = torch.cat(self.reward_group.run_sharded("score", self.reward_group.split(batch)))
            metrics["reward_mean"] = float(scores.mean())
            per_prompt["reward"] = scores.float().flatten()
            for sample, score in zip(shown, scores.tolist()):
                sample["reward_model_score"] = score
        self.samples += shown
        return {prompt_set.key(f"{prefix}{key}"): value for key, value in metrics.items()}

    def comparisons(self) -> dict[str, float]:
        """The policy against each other model on the same prompts of each set: accuracy and reward gains and the
        reward model's win rate, each with its 95% interval (`_low`, `_high`); none on fewer than two prompts."""
        metrics: dict[str, float] = {}
        for prompt_set in self.prompt_sets:
            policy = self.per_prompt.get((prompt_set.name, "policy"), {})
            for other in ("reference", "production"):
                for score, baseline in self.per_prompt.get((prompt_set.name, other), {}).items():
                    if score not in policy or len(policy[score]) < 2:
                        continue
                    found = {f"{score}_gain_vs_{other}": paired_gain(policy[score], baseline)}
                    if score == "reward":
                        found[f"win_rate_vs_{other}"] = win_rate(policy[score], baseline)
                    for key, (value, low, high) in found.items():
                        key = prompt_set.key(key)
                        metrics |= {key: value, f"{key}_low": low, f"{key}_high": high}
        return metrics

    def rewards(self, model: str, rollouts: list[Rollout], labels: list[str]) -> torch.Tensor:
        """The reward of every answer; RewardsUnavailable when any request failed after its retries."""
        batch = self.reward_source([r.prompt + r.response_text for r in rollouts], [r.prompt for r in rollouts],
                                   labels)
        failed = int(batch.failed.sum())
        if failed:
            raise RewardsUnavailable(
                f"{self.reward_source.name}: {failed} of {len(rollouts)} reward requests for the {model}'s answers "
                f"failed after their retries ({'; '.join(batch.errors[-3:])}); not scoring the models on different "
                "prompts: the stage fails, to be retried")
        return batch.rewards

    def policy_samples(self) -> list[Rollout]:
        """Samples of the loaded policy at temperature 1 with their log-probs on the first prompt set (--prompt_data
        where given): the KL is an expectation under it."""
        prompts = [p["prompt"] for p in self.prompt_sets[0].prompts]
        return generate_across(self.engines, prompts, seed=self.cfg.seed + 2, n=1,
                               max_new_tokens=self.cfg.generate_max_len, temperature=1.0, top_p=1.0, logprobs=True)

    def kl_to_loaded(self, samples: list[Rollout]) -> float:
        """Mean over prompts of sum_t (log π − log π_loaded) on the policy's samples."""
        loaded = score_across(self.engines, [(r.prompt_ids, list(r.response_ids)) for r in samples])
        return sum(sum(r.logprobs) - sum(ref) for r, ref in zip(samples, loaded)) / len(samples)

    def close(self) -> None:
        for engine in self.engines:
            ray.kill(engine)


def logprob_gap(cfg, path: str, samples: list[Rollout], bundle: dict[str, float]) -> dict[str, float]:
    """How far the engines' log-probs of the policy's samples are from the policy's own as the trainer computes
    them (transformers, on the engines' resources once they are gone): mean and largest |difference| per token."""
    [scorer] = create_rollout_engines(path, backend="hf", seed=cfg.seed, dtype="bfloat16" if cfg.bf16 else "float32",
                                      num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0),
                                      cpu_threads=cpu_threads(1))
    try:
        scored = ray.get(scorer.score_tokens.remote([(r.prompt_ids, list(r.response_ids)) for r in samples]))
    finally:
        ray.kill(scorer)
    diff = torch.cat([(torch.tensor(r.logprobs) - torch.tensor(own)).abs() for r, own in zip(samples, scored)])
    return {"logprob_gap_mean": float(diff.mean()), "logprob_gap_max": float(diff.max()),
            "logprob_gap_samples": len(samples)}


def benchmark_prompts(benchmark: Benchmark, cfg, tokenizer) -> list[dict]:
    """The prompts of one benchmark, rendered and tokenized as the stage's prompts are, with their labels."""
    rows = data.load_rows(benchmark.dataset, split=benchmark.split, max_samples=benchmark.max_samples,
                          subset=benchmark.subset)
    prompts, labels = benchmark_rows(benchmark, rows, cfg)
    return data.encode_prompts(datasets.Dataset.from_dict({"prompt": prompts, "label": labels}), tokenizer,
                               input_key="prompt", label_key="label", apply_chat_template=cfg.apply_chat_template,
                               prompt_max_len=cfg.prompt_max_len, input_template=cfg.input_template).kept()


def harness_tasks(cfg):
    """lm-eval's task index with every task --lm_eval names, checked before any engine starts (None without it)."""
    if not cfg.lm_eval:
        return None
    try:
        from stages.evaluate import harness  # an optional extra, imported where asked for
    except ImportError as error:
        raise StageInputError(f"--lm_eval needs lm-evaluation-harness ({error}): pip install -e '.[lm_eval]'"
                              ) from error
    return harness.task_manager(cfg)


def harness_metrics(cfg, tasks, evaluation: Evaluation, tokenizer, model: str) -> dict[str, float]:
    """--lm_eval's tasks answered by the model in the engines (none without the flag)."""
    if tasks is None:
        return {}
    from stages.evaluate import harness

    return harness.run_tasks(cfg, tasks, evaluation.engines, tokenizer, model)


def check_scorable(prompt_sets: list[PromptSet], cfg) -> None:
    """Refuse, before any engine starts, a prompt set nothing could score."""
    for prompt_set in prompt_sets:
        what = f"benchmark {prompt_set.name} ({prompt_set.format})" if prompt_set.name else "--prompt_data"
        if prompt_set.format == "preference_prompts" and not cfg.reward_pretrain:
            raise StageInputError(f"{what} is judged by a reward model: set --reward_pretrain")
        if prompt_set.format == "prompts" and not (cfg.reward_pretrain or cfg.remote_rm_url or cfg.agent_func_path):
            raise StageInputError(f"{what} is scored by the stage's reward: set --remote_rm_url, --reward_pretrain or "
                             "--agent_func_path")
        if not prompt_set.prompts:
            raise StageInputError(f"{what} has no prompts to evaluate on")


def run(cfg) -> dict[str, Any]:
    from stages.evaluate.config import EvaluateConfig
    from stages.model_io import load_tokenizer, resolve_model_path

    models = {"policy": cfg.pretrain, "reference": cfg.ref_pretrain, "production": cfg.production_pretrain}
    models = {name: resolve_model_path(path) for name, path in models.items() if path}
    tokenizer = load_tokenizer(models["policy"])
    prompt_sets = []
    if cfg.prompt_data:
        rows = data.load_mixture(cfg.prompt_data, split=cfg.prompt_split, max_samples=cfg.max_samples,
                                 validate=cfg.validate_rows)
        # Cached as the RL stage's prompts are; answered whole, so read whole.
        examples = prepared.prepare_prompts(cfg, tokenizer, rows, stage="evaluate")
        prompt_sets.append(PromptSet("", "prompts", list(examples), cfg.eval_n_samples_per_prompt))
    for benchmark in cfg.eval_suite or []:
        prompt_sets.append(PromptSet(benchmark.name, benchmark.format, benchmark_prompts(benchmark, cfg, tokenizer),
                                     benchmark.n_samples))
    check_scorable(prompt_sets, cfg)
    tasks = harness_tasks(cfg)
    init_ray()
    device = cluster_device(cfg.device)
    note_limits("evaluate", cfg, device)
    bundles = group_bundles(cfg)
    bundle = bundle_resources(cfg, device, sum(bundles.values()), ray.cluster_resources().get("CPU", 1))
    reward_group = None
    if cfg.reward_pretrain:
        group = placement_group([dict(bundle) for _ in range(bundles["reward"])], strategy="PACK")
        ray.get(group.ready())
        reward_group = ActorGroup(RewardModelWorker, cfg.world_size, device, name="reward",
                                  placement=Placement(group, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                                                      owned=True), threads=cpu_threads(cfg.num_gpus_per_node))
        ray.get(reward_group.rendezvous())
        reward_group.run("setup", cfg.model_dump(), EvaluateConfig)
    evaluation = Evaluation(cfg, prompt_sets, tokenizer, reward_group, bundle)
    try:
        evaluation.load(models["policy"])
        metrics = {}
        for prompt_set in prompt_sets:
            metrics |= evaluation.score("policy", prompt_set)
        metrics |= harness_metrics(cfg, tasks, evaluation, tokenizer, "policy")
        measure_gap = (cfg.logprob_gap_samples > 0 and cfg.vllm_tensor_parallel_size == 1
                       and resolve_backend(cfg.rollout_backend) == "vllm")
        samples = evaluation.policy_samples() if "reference" in models or measure_gap else []
        for name in ("reference", "production"):
            if name in models:
                evaluation.load(models[name])
                for prompt_set in prompt_sets:
                    metrics |= evaluation.score(name, prompt_set)
                metrics |= harness_metrics(cfg, tasks, evaluation, tokenizer, name)
                if name == "reference":
                    metrics["kl_mean"] = evaluation.kl_to_loaded(samples)
    finally:
        evaluation.close()
        if reward_group is not None:
            reward_group.shutdown()
    if measure_gap:
        metrics |= logprob_gap(cfg, models["policy"], samples[: cfg.logprob_gap_samples], bundle)
    metrics |= evaluation.comparisons()
    for prompt_set in prompt_sets:
        metrics[prompt_set.key("prompts")] = len(prompt_set.prompts)
    ds.write_metrics(cfg.save_path, metrics)
    with open(Path(cfg.save_path) / "samples.jsonl", "w") as out:
        for sample in evaluation.samples:
            out.write(json.dumps(sample) + "\n")
    log = StepLog("evaluate", cfg, total_steps=0)
    log.summary(metrics)
    log.close()
    ray.shutdown()
    return {"metrics": metrics}
