"""Agents and environments for RL (`--agent_func_path FILE`), with OpenRLHF's interface.

The file defines `AgentExecutor`. Most build it from an `AgentInstance` class, one instance per episode:

    from stages.rl.agents import AgentInstanceBase, MultiTurnAgentExecutor   # OpenRLHF: openrlhf.utils.agent

    class AgentInstance(AgentInstanceBase):
        async def reset(self, states):   # {"observation": prompt, "label": label} -> {"observation": text}
        async def step(self, states):    # {"observation_text", "action_text", "label", "sampling_params"} ->
            return {"rewards": r, "scores": s, "environment_feedback": text, "done": bool,
                    "sampling_params": params or None, "extra_logs": {name: number}}

    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self):
            super().__init__(AgentInstance)

An episode alternates the model's turns and the environment's feedback in one token sequence that fits --max_len:
each turn may use the room left. The loss trains the model's own tokens only (`action_ranges`); the episode's
reward is the sum of its steps' rewards. An executor may instead define its own `async execute(prompt, label,
sampling_params, max_length, hf_tokenizer, llm_engine)` returning OpenRLHF's dict (observation_tokens,
action_ranges, reward, scores, rollout_log_probs, extra_logs).

Episodes run concurrently on one event loop; their generate calls are batched: a batch goes to the rollout
engines when every unfinished episode waits for one, in episode order, so a run repeats itself. An agent that
raises, returns a malformed dict or takes longer than --agent_timeout in one call stops the stage (exit 2) with the
file, the method and the prompt named.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import inspect
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.errors import StageInputError
from stages.rewards import project_file

if TYPE_CHECKING:
    from stages.rewards import RewardBatch
    from stages.rl.rollout import Rollout

# Which episode a coroutine belongs to: the engine client batches requests in episode order.
_EPISODE: contextvars.ContextVar[int] = contextvars.ContextVar("episode")


class AgentError(StageInputError):
    """An agent file that cannot run, or answered something unusable (exit 2)."""


# ----------------------------------------------------------------------------- OpenRLHF's interface

@dataclass
class SamplingParams:
    """What a turn samples with (the attributes of vLLM's SamplingParams an agent reads or sets)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    logprobs: int | None = None  # 0 or more: return the sampled tokens' log-probs


class AgentInstanceBase(ABC):
    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError("AgentExecutorBase.execute is not implemented")


class MultiTurnAgentExecutor(AgentExecutorBase):
    """One `agent_instance_cls` per episode: reset, then model turn and environment step until done or no room."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("MultiTurnAgentExecutor needs a subclass of AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        instance = await _agent_call("AgentInstance.__init__", self.agent_instance_cls)
        reset = await _agent_call("AgentInstance.reset", instance.reset, {"observation": prompt, "label": label})
        observation_text = _field(reset, "observation", str, "AgentInstance.reset")
        tokens = hf_tokenizer(observation_text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= max_length:
            raise AgentError(f"AgentInstance.reset: the first observation has {len(tokens)} tokens, no room left in "
                             f"--max_len {max_length}")
        logprobs = [0.0] * len(tokens) if sampling_params.logprobs is not None else None
        action_ranges, total_reward, scores, extra_logs = [], 0.0, None, {}
        while len(tokens) < max_length:
            params = deepcopy(sampling_params)
            params.max_tokens = max_length - len(tokens)  # each turn may use the room left
            output = (await llm_engine.generate(tokens, params)).outputs[0]
            action = list(output.token_ids)
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            result = await _agent_call("AgentInstance.step", instance.step, {
                "observation_text": observation_text, "action_text": output.text, "label": label,
                "sampling_params": params})
            step = _checked_step(result)
            total_reward += step["rewards"]
            scores = step["scores"] if step["scores"] is not None else total_reward
            extra_logs = step["extra_logs"]
            room = max_length - len(tokens) - len(action)
            feedback = hf_tokenizer(step["environment_feedback"], add_special_tokens=False)["input_ids"][:room]
            observation_text += output.text + step["environment_feedback"]
            tokens = tokens + action + feedback
            if logprobs is not None:
                logprobs += [entry[token].logprob for entry, token in zip(output.logprobs, action)]
                logprobs += [0.0] * len(feedback)
            if step["sampling_params"] is not None:
                sampling_params = step["sampling_params"]
            if step["done"]:
                break
        return {"prompt": prompt, "label": label, "reward": total_reward, "scores": scores,
                "observation_tokens": tokens, "action_ranges": action_ranges, "rollout_log_probs": logprobs,
                "extra_logs": extra_logs}


# ----------------------------------------------------------------------------- checks of what an agent answers

def _number(value: Any, what: str, method: str) -> float:
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise AgentError(f"{method} returned {what} {value!r}, not a number ({error})") from None
    if not math.isfinite(number):
        raise AgentError(f"{method} returned a non-finite {what}: {number}")
    return number


def _field(result: Any, key: str, kind: type, method: str) -> Any:
    if not isinstance(result, dict):
        raise AgentError(f"{method} returned {type(result).__name__}, not a dict")
    if key not in result:
        raise AgentError(f"{method} returned no '{key}' (keys: {sorted(result)})")
    if not isinstance(result[key], kind):
        raise AgentError(f"{method} returned '{key}' of type {type(result[key]).__name__}, not {kind.__name__}")
    return result[key]


def _checked_step(result: Any) -> dict[str, Any]:
    method = "AgentInstance.step"
    done = _field(result, "done", object, method)
    if hasattr(done, "item"):
        done = bool(done.item())
    if not isinstance(done, bool):
        raise AgentError(f"{method} returned 'done' {result['done']!r}, not a bool")
    params = result.get("sampling_params")
    if params is not None and not all(hasattr(params, name) for name in ("temperature", "top_p", "max_tokens")):
        raise AgentError(f"{method} returned sampling_params {params!r} without temperature, top_p and max_tokens")
    rewards = _number(_field(result, "rewards", object, method), "'rewards'", method)
    scores = result.get("scores")
    return {"rewards": rewards, "scores": None if scores is None else _number(scores, "'scores'", method),
            "environment_feedback": _field(result, "environment_feedback", str, method), "done": done,
            "sampling_params": params, "extra_logs": _extra_logs(result.get("extra_logs"), method)}


def _extra_logs(logs: Any, method: str) -> dict[str, float]:
    if logs is None:
        return {}
    if not isinstance(logs, dict):
        raise AgentError(f"{method} returned 'extra_logs' of type {type(logs).__name__}, not a dict")
    return {str(key): _number(value, f"extra_logs['{key}']", method) for key, value in logs.items()}


@dataclass
class Episode:
    """One finished episode: the first observation's tokens, then the model's and the environment's tokens."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]  # 1 on the model's own tokens
    logprobs: list[float] | None  # of the response tokens (0 on the environment's)
    reward: float
    score: float
    extra_logs: dict[str, float]
    finish_reason: str  # "length" when the episode ran out of room before it was done


def episode_of(result: Any, max_length: int) -> Episode:
    """Check an executor's answer (OpenRLHF's dict) and cut it into prompt and response."""
    method = "AgentExecutor.execute"
    tokens = _field(result, "observation_tokens", list, method)
    ranges = _field(result, "action_ranges", list, method)
    if not ranges:
        raise AgentError(f"{method} returned no action_ranges: the model never took a turn")
    previous = 0
    for start, end in ranges:
        if not previous <= start <= end <= len(tokens):
            raise AgentError(f"{method} returned action range ({start}, {end}) outside the episode's "
                             f"{len(tokens)} tokens or before the previous one")
        previous = end
    if len(tokens) > max_length:
        raise AgentError(f"{method} returned {len(tokens)} tokens, more than --max_len {max_length}")
    first = ranges[0][0]
    mask = [0] * (len(tokens) - first)
    for start, end in ranges:
        mask[start - first : end - first] = [1] * (end - start)
    logprobs = result.get("rollout_log_probs")
    if logprobs is not None and len(logprobs) != len(tokens):
        raise AgentError(f"{method} returned {len(logprobs)} rollout_log_probs for {len(tokens)} tokens")
    reward = _number(result.get("reward"), "'reward'", method)
    score = result.get("scores")
    return Episode(tokens[:first], tokens[first:], mask, None if logprobs is None else list(logprobs[first:]), reward,
                   reward if score is None else _number(score, "'scores'", method),
                   _extra_logs(result.get("extra_logs"), method),
                   "length" if len(tokens) >= max_length else "stop")


# ----------------------------------------------------------------------------- calls watched for hangs

class EngineFailure(RuntimeError):
    """The rollout engines failed under an agent's generate call: not the agent's fault (the stage may retry)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class _Watch:
    """The agent code running now in each episode, since when: a watchdog names one that runs too long. Time an
    episode spends waiting for the engines is not the agent's."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls: dict[int, tuple[str, float]] = {}  # episode -> (method, started)

    def enter(self, episode: int, method: str | None) -> str | None:
        """Mark `method` (None: none) as running in `episode`; returns the one it replaces."""
        with self.lock:
            previous = self.calls.pop(episode, (None, 0.0))[0]
            if method is not None:
                self.calls[episode] = (method, time.monotonic())
            return previous


_WATCH: contextvars.ContextVar[_Watch] = contextvars.ContextVar("watch")


async def _agent_call(method: str, function: Callable, *args):
    """function(*args), awaited if it returns an awaitable, watched and with its errors named after `method`."""
    watch, episode = _WATCH.get(), _EPISODE.get()
    outer = watch.enter(episode, method)
    try:
        result = function(*args)
        return await result if inspect.isawaitable(result) else result
    except (AgentError, EngineFailure, asyncio.CancelledError):
        raise
    except Exception as error:
        raise AgentError(f"{method} raised {type(error).__name__}: {error}") from error
    finally:
        watch.enter(episode, outer)


# ----------------------------------------------------------------------------- the engines as `llm_engine`

@dataclass
class _Logprob:
    logprob: float


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, _Logprob]] | None
    finish_reason: str


@dataclass
class _RequestOutput:
    outputs: list[_Completion]


@dataclass
class _Request:
    episode: int
    token_ids: list[int]
    params: Any
    future: asyncio.Future = field(repr=False)


class EngineClient:
    """`llm_engine.generate(token_ids, sampling_params)` for the episodes of one call of `run_episodes`.

    `extend(sequences, budgets, temperature=, top_p=, seed=, logprobs=)` samples on the rollout engines (it runs on a
    worker thread); requests wait until every unfinished episode has one, then go as one batch per sampling setting.
    """

    def __init__(self, extend: Callable[..., list], tokenizer, seed: int, episodes: int):
        self.extend, self.tokenizer, self.seed, self.running = extend, tokenizer, seed, episodes
        self.pending: list[_Request] = []
        self.dispatching = False
        self.batches = 0

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None) -> _RequestOutput:
        if multi_modal_data:
            raise AgentError("llm_engine.generate: images are not supported here")
        future = asyncio.get_running_loop().create_future()
        episode = _EPISODE.get()
        self.pending.append(_Request(episode, list(prompt_token_ids), sampling_params, future))
        self._maybe_dispatch()
        watching = _WATCH.get().enter(episode, None)  # waiting for the engines
        try:
            return await future
        finally:
            _WATCH.get().enter(episode, watching)

    def finished(self) -> None:
        self.running -= 1
        self._maybe_dispatch()

    def _maybe_dispatch(self) -> None:
        waiting = {request.episode for request in self.pending}  # an episode may wait on several requests
        if waiting and len(waiting) >= self.running and not self.dispatching:
            batch, self.pending = sorted(self.pending, key=lambda r: r.episode), []
            self.dispatching = True
            asyncio.get_running_loop().create_task(self._dispatch(batch))

    async def _dispatch(self, batch: list[_Request]) -> None:
        try:
            settings: dict[tuple, list[_Request]] = {}
            for request in batch:
                p = request.params
                settings.setdefault((float(p.temperature), float(p.top_p), p.logprobs is not None), []).append(request)
            for k, ((temperature, top_p, logprobs), requests) in enumerate(settings.items()):
                extensions = await asyncio.to_thread(
                    self.extend, [r.token_ids for r in requests], [max(1, int(r.params.max_tokens)) for r in requests],
                    temperature=temperature, top_p=top_p, seed=self.seed + 1009 * self.batches + k, logprobs=logprobs)
                for request, extension in zip(requests, extensions):
                    entries = (None if extension.logprobs is None else
                               [{t: _Logprob(lp)} for t, lp in zip(extension.token_ids, extension.logprobs)])
                    text = self.tokenizer.decode(extension.token_ids, skip_special_tokens=True)
                    request.future.set_result(_RequestOutput([_Completion(extension.token_ids, text, entries,
                                                                          extension.finish_reason)]))
        except Exception as error:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(EngineFailure(error))
        finally:
            self.batches += 1
            self.dispatching = False
            self._maybe_dispatch()


# ----------------------------------------------------------------------------- running episodes

def load_agent_executor(path: str) -> AgentExecutorBase:
    """`AgentExecutor()` of the agent file (relative paths also resolve against the project root)."""
    file = project_file(path)
    if not file.is_file() or file.suffix != ".py":
        raise AgentError(f"--agent_func_path {path}: not a Python file")
    spec = importlib.util.spec_from_file_location(f"agent_module_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        executor = module.AgentExecutor()
    except AttributeError as error:
        if not hasattr(module, "AgentExecutor"):
            raise AgentError(f"--agent_func_path {file}: the file defines no AgentExecutor") from None
        raise AgentError(f"--agent_func_path {file}: AgentExecutor() failed: {error}") from error
    except Exception as error:
        raise AgentError(f"--agent_func_path {file}: loading it failed: {type(error).__name__}: {error}") from error
    if not callable(getattr(executor, "execute", None)):
        raise AgentError(f"--agent_func_path {file}: AgentExecutor has no execute method")
    executor.source = str(file)
    return executor


def run_episodes(executor: AgentExecutorBase, prompts: list[str], labels: list[str], sampling: SamplingParams,
                 max_length: int, tokenizer, extend: Callable[..., list], seed: int, timeout_s: float,
                 ) -> list[Episode]:  # fmt: skip
    """One episode per prompt (repeat a prompt for several samples), all at once; in prompt order."""
    watch = _Watch()
    client = EngineClient(extend, tokenizer, seed, len(prompts))
    source = getattr(executor, "source", "the agent file")
    results: list[Any] = [None] * len(prompts)
    failure: list[BaseException] = []

    async def episode(index: int) -> None:
        _EPISODE.set(index)
        _WATCH.set(watch)
        try:
            result = await _agent_call("AgentExecutor.execute", executor.execute, prompts[index], labels[index],
                                       deepcopy(sampling), max_length, tokenizer, client)
            results[index] = episode_of(result, max_length)
        except AgentError as error:
            failure.append(AgentError(f"--agent_func_path {source}: {error} (prompt {index}: "
                                      f"{prompts[index][-80:]!r})"))
            raise
        except EngineFailure as error:
            failure.append(error.error)
            raise
        finally:
            client.finished()

    async def main() -> None:
        tasks = [asyncio.ensure_future(episode(i)) for i in range(len(prompts))]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    done = threading.Event()
    loop_error: list[BaseException] = []

    def run_loop() -> None:
        try:
            asyncio.run(main())
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            loop_error.append(error)
        finally:
            done.set()

    # The loop runs on a thread of its own, so a call that blocks it (time.sleep in an async step) is seen too.
    threading.Thread(target=run_loop, name="agent-episodes", daemon=True).start()
    while not done.wait(0.2):
        now = time.monotonic()
        with watch.lock:
            late = [(episode, method) for episode, (method, started) in watch.calls.items()
                    if now - started > timeout_s]
        if late:
            episode, method = late[0]
            raise AgentError(f"--agent_func_path {source}: {method} took more than --agent_timeout {timeout_s:g} s "
                             f"(prompt {episode}: {prompts[episode][-80:]!r})")
    if failure:
        raise failure[0]
    if loop_error:
        raise loop_error[0]
    return results


def agent_rollouts(executor: AgentExecutorBase, engines: list, tokenizer, prompts: list[dict], *, n: int,
                   temperature: float, top_p: float, max_new_tokens: int, max_length: int, seed: int,
                   logprobs: bool, timeout_s: float) -> tuple[list[Rollout], RewardBatch]:
    """`n` episodes per prompt on the rollout engines, as rollouts (the first observation as prompt, the rest as
    response with a mask of the model's tokens) and their rewards."""
    import torch

    from stages.rewards import RewardBatch
    from stages.rl.rollout import Rollout, extend_across

    texts = [p["prompt"] for p in prompts for _ in range(n)]
    labels = [p["label"] for p in prompts for _ in range(n)]
    sampling = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                              logprobs=0 if logprobs else None)
    episodes = run_episodes(executor, texts, labels, sampling, max_length, tokenizer,
                            lambda *args, **kwargs: extend_across(engines, *args, **kwargs), seed, timeout_s)
    rollouts = [Rollout(prompt_index=k // n, prompt=texts[k], response_ids=e.response_ids,
                        response_text=tokenizer.decode(e.response_ids, skip_special_tokens=True), logprobs=e.logprobs,
                        finish_reason=e.finish_reason, prompt_ids=e.prompt_ids, response_mask=e.response_mask)
                for k, e in enumerate(episodes)]
    extra = {key: sum(e.extra_logs.get(key, 0.0) for e in episodes) / len(episodes)
             for key in {key for e in episodes for key in e.extra_logs}}
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    return rollouts, RewardBatch(rewards, torch.tensor([e.score for e in episodes], dtype=torch.float32),
                                 torch.zeros(len(episodes), dtype=torch.bool), extra)
