"""lm-evaluation-harness tasks answered through the evaluation's own engines (`--lm_eval gsm8k,ifeval`; the `lm_eval`
extra, `pip install -e .[lm_eval]`).

lm-eval builds each task's requests (prompts, few-shot examples, answer filters, metrics) and asks a model three
things; `EngineLM` answers them with the engines the stage already holds, so the harness sees the policy, the
reference and production as they are loaded, in one engine start:
- `generate_until`: the engines' answer to the context, cut at the first of the task's `until` strings;
- `loglikelihood`: the continuation's summed log-prob teacher-forced after the context (`score_tokens`), and whether
  greedy decoding from the context would have produced it (a greedy extension of the continuation's length);
- `loglikelihood_rolling`: the whole text's log-prob in windows of the engines' context length (lm-eval's own
  window split).
Contexts longer than the engines' context length keep their last tokens, as lm-eval's HF model does.

Metrics: `lm_eval/<task>/<metric>` for the policy (`<metric>_<filter>` where the task filters answers, e.g.
`exact_match_strict-match`), with `reference_` / `production_` before the metric for the other models, as the
evaluation's other metrics.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.tasks import TaskManager
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from stages.errors import StageInputError
from stages.rl.rollout import encode_prompt, extend_across, generate_across, score_across


class EngineLM(TemplateLM):
    """lm-eval's model interface over rollout engines that hold one model at a time."""

    def __init__(self, engines: list, tokenizer, *, max_len: int, max_new_tokens: int, seed: int):
        super().__init__()
        self.engines, self.tokenizer = engines, tokenizer
        self.max_len, self.max_new_tokens, self.seed = max_len, max_new_tokens, seed

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # An empty context is conditioned on bos where the tokenizer has one (lm-eval's default: eos).
        return self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.eot_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:  # a rendered chat template carries its own bos
            return encode_prompt(self.tokenizer, string)
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template else None

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _fitted(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Context and continuation within the engines' context length: the context keeps its last tokens."""
        if len(continuation) >= self.max_len:
            raise ValueError(f"an lm-eval continuation of {len(continuation)} tokens does not fit the engines' "
                             f"context of {self.max_len} (--prompt_max_len + --generate_max_len): raise them")
        return context[-(self.max_len - len(continuation)):], continuation

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [self._fitted(context, continuation) for _, context, continuation in requests]
        scored = score_across(self.engines, pairs)
        greedy = extend_across(self.engines, [context for context, _ in pairs],
                               [len(continuation) for _, continuation in pairs], seed=self.seed, temperature=0.0,
                               top_p=1.0)
        return [(float(sum(logprobs)), list(extension.token_ids) == list(continuation))
                for (_, continuation), logprobs, extension in zip(pairs, scored, greedy)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            for window in get_rolling_token_windows(token_list=self.tok_encode(text, add_special_tokens=False),
                                                    prefix_token=self.prefix_token_id, max_seq_len=self.max_len - 1,
                                                    context_len=1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, logprobs in zip(owners, score_across(self.engines, windows)):
            totals[owner] += float(sum(logprobs))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        # Requests that sample alike go to the engines together.
        groups: dict[tuple[int, float], list[int]] = {}
        settings = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.get("until") or []
            temperature = float(gen_kwargs.get("temperature", 0.0)) if gen_kwargs.get("do_sample", False) else 0.0
            max_new = int(gen_kwargs.get("max_gen_toks", self.max_new_tokens))
            settings.append((context, [until] if isinstance(until, str) else list(until)))
            groups.setdefault((max_new, temperature), []).append(index)
        answers: list[str] = [""] * len(requests)
        for (max_new, temperature), indices in groups.items():
            rollouts = generate_across(self.engines, [settings[i][0] for i in indices], seed=self.seed, n=1,
                                       max_new_tokens=max_new, temperature=temperature, top_p=1.0,
                                       max_total_len=self.max_len)
            for index, rollout in zip(indices, rollouts):
                text = rollout.response_text
                for stop in settings[index][1]:
                    text = text.split(stop, 1)[0]
                answers[index] = text
        return answers


def metric_key(task: str, metric: str, prefix: str) -> str:
    """`lm_eval/<task>/<prefix><metric>`, lm-eval's `metric,filter` written `metric_filter` (no filter: the metric)."""
    name, _, answer_filter = metric.partition(",")
    if answer_filter and answer_filter != "none":
        name = f"{name}_{answer_filter}"
    return f"lm_eval/{task}/{prefix}{re.sub(r'[^A-Za-z0-9_.@-]', '_', name)}"


def task_manager(cfg) -> TaskManager:
    """lm-eval's index of its tasks and --lm_eval_include_path's; every task --lm_eval names must be in it. Indexing
    lm-eval's own ~15,000 tasks takes about 10 s of a core: a run that names local tasks only skips it."""
    if cfg.lm_eval_include_path:
        local = TaskManager(include_path=cfg.lm_eval_include_path, include_defaults=False)
        check_local_metrics(local, cfg.lm_eval_include_path)
        if all(local.match_tasks([task]) for task in cfg.lm_eval):
            return local
    tasks = TaskManager(include_path=cfg.lm_eval_include_path)
    unknown = [task for task in cfg.lm_eval if not tasks.match_tasks([task])]
    if unknown:
        raise StageInputError(f"--lm_eval: no lm-eval task or group named {', '.join(unknown)}"
                              + ("" if cfg.lm_eval_include_path else " (local task files: --lm_eval_include_path)"))
    return tasks


def check_local_metrics(tasks: TaskManager, include_path: str) -> None:
    """Every metric of the local task files is lm-eval's own or a `!function` of the folder: lm-eval loads any other
    name from the Hugging Face hub with `evaluate.load`, which runs the metric's code from there."""
    import lm_eval.api.metrics  # noqa: F401 - fills the registry
    from lm_eval.api.registry import metric_registry

    folder = str(Path(include_path).expanduser().resolve())
    refused = []
    for name, entry in tasks.task_index.items():
        for metric in (getattr(entry, "cfg", None) or {}).get("metric_list") or []:
            value = metric.get("metric") if isinstance(metric, dict) else None
            local_function = isinstance(value, str) and str(Path(value).resolve()).startswith(folder + "/")
            if metric.get("hf_evaluate") is True or not (value in metric_registry or local_function):
                refused.append(f"{name}: {value!r}")
    if refused:
        raise StageInputError(f"--lm_eval_include_path {include_path}: metrics neither lm-eval's own nor a !function "
                              f"of the folder ({'; '.join(refused)}): lm-eval would load them from the hub and run "
                              "their code")


def run_tasks(cfg, tasks: TaskManager, engines: list, tokenizer, model: str) -> dict[str, float]:
    """The metrics of the model in the engines on --lm_eval's tasks, named as `model`'s (no prefix: the policy)."""
    lm = EngineLM(engines, tokenizer, max_len=cfg.prompt_max_len + cfg.generate_max_len,
                  max_new_tokens=cfg.generate_max_len, seed=cfg.seed)
    # --max_samples cuts each task only where set below its default (lm-eval warns that any limit is for testing).
    cut = cfg.max_samples < type(cfg).model_fields["max_samples"].default
    results: dict[str, Any] = simple_evaluate(
        model=lm, tasks=list(cfg.lm_eval), task_manager=tasks,
        limit=cfg.max_samples if cut else None, apply_chat_template=cfg.apply_chat_template,
        log_samples=False, bootstrap_iters=0, random_seed=cfg.seed, numpy_random_seed=cfg.seed,
        torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed,
    )
    prefix = "" if model == "policy" else f"{model}_"
    metrics = {}
    for task, values in results["results"].items():
        for metric, value in values.items():
            if "," in metric and "_stderr" not in metric and isinstance(value, (int, float)) and math.isfinite(value):
                metrics[metric_key(task, metric, prefix)] = float(value)
    return metrics
