"""Agents (`--agent_func_path`) without engines: episodes run against a scripted `extend`, token by token.

The tiny task's second-try agent, an agent file written to OpenRLHF's example interface (only its import line
changed), the calculator tool agent, and agents that break: each must stop the stage naming the file, the method
and the prompt.
"""

from __future__ import annotations

import pytest

from stages.rl.agents import AgentError, SamplingParams, load_agent_executor, run_episodes
from stages.rl.rollout import Extension
from stages.tiny import ASSISTANT_TOKEN, EOS_TOKEN, USER_TOKEN, build_tokenizer

TOKENIZER = build_tokenizer()
PROMPT = f"{USER_TOKEN}What is 3 plus 4?{ASSISTANT_TOKEN}"


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


class ScriptedEngines:
    """`extend` answering each episode's turns from a script: {prompt text: [turn texts]} (the last one repeats);
    one episode per prompt."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = {tuple(ids(prompt)): turns for prompt, turns in script.items()}
        self.turns = dict.fromkeys(self.script, 0)
        self.batches: list[list[int]] = []  # the budgets of each call

    def __call__(self, sequences, budgets, *, temperature, top_p, seed, logprobs):
        self.batches.append(list(budgets))
        out = []
        for sequence, budget in zip(sequences, budgets):
            prompt = next(p for p in self.script if tuple(sequence[: len(p)]) == p)
            turns, turn = self.script[prompt], self.turns[prompt]
            self.turns[prompt] += 1
            tokens = ids(turns[min(turn, len(turns) - 1)])[:budget]
            eos = TOKENIZER.eos_token_id
            out.append(Extension(tokens, [-0.5] * len(tokens) if logprobs else None,
                                 "stop" if tokens and tokens[-1] == eos else "length"))
        return out


def episodes(agent: str, script: dict[str, list[str]], max_length: int = 64, timeout_s: float = 5.0,
             logprobs: bool = True, labels: list[str] | None = None):
    engines = ScriptedEngines(script)
    prompts = list(script)
    result = run_episodes(load_agent_executor(agent), prompts, labels or ["7"] * len(prompts),
                          SamplingParams(max_tokens=16, logprobs=0 if logprobs else None), max_length, TOKENIZER,
                          engines, seed=0, timeout_s=timeout_s)
    return result, engines


def test_a_second_try_episode_trains_the_models_tokens_only():
    wrong, right = f"Answer: 8{EOS_TOKEN}", f"Answer: 7{EOS_TOKEN}"
    [episode], engines = episodes("stages/tiny_agent.py", {PROMPT: [wrong, right]})
    feedback = ids(f"{USER_TOKEN}No, less.{ASSISTANT_TOKEN}")
    assert episode.prompt_ids == ids(PROMPT)
    assert episode.response_ids == ids(wrong) + feedback + ids(right)
    assert episode.response_mask == [1] * len(ids(wrong)) + [0] * len(feedback) + [1] * len(ids(right))
    assert episode.logprobs == [-0.5] * len(ids(wrong)) + [0.0] * len(feedback) + [-0.5] * len(ids(right))
    assert episode.reward == 1.0 and episode.extra_logs == {"first_try": 0.0} and episode.finish_reason == "stop"
    # Each turn may use the room left of --max_len.
    assert engines.batches == [[64 - len(ids(PROMPT))], [64 - len(ids(PROMPT)) - len(ids(wrong)) - len(feedback)]]


def test_episodes_run_together_in_batches_and_fit_the_length_budget():
    long_prompt = f"{USER_TOKEN}Tom has 1 apples and gets 8 more. How many apples does he have?{ASSISTANT_TOKEN}"
    script = {PROMPT: [f"Answer: 7{EOS_TOKEN}"],
              long_prompt: [f"Answer: 8{EOS_TOKEN}", "Answer: 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9"]}
    result, engines = episodes("stages/tiny_agent.py", script, max_length=len(ids(long_prompt)) + 20,
                               labels=["7", "9"])
    assert [len(batch) for batch in engines.batches] == [2, 1]  # both first turns at once, then the second try
    solved, cut = result
    assert solved.reward == 1.0 and solved.extra_logs == {"first_try": 1.0}
    assert len(cut.prompt_ids) + len(cut.response_ids) == len(ids(long_prompt)) + 20
    assert cut.finish_reason == "length" and cut.reward == 0.0


OPENRLHF_STYLE_AGENT = '''
import random
from typing import Any, Dict

import torch

from stages.rl.agents import AgentInstanceBase, MultiTurnAgentExecutor  # was: from openrlhf.utils.agent import ...


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = random.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        done = self.step_idx >= self.max_steps
        reward = torch.randint(0, 2, (1,)).float() if done else torch.tensor(0)
        environment_feedback = "\\n\\nHuman: [CORRECT]\\n</s>" if done else "\\n\\nHuman: [INCORRECT]\\n</s>\\n\\nAssistant: "
        self.step_idx += 1
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": environment_feedback,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"dummy_scores": reward},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_an_agent_file_written_for_openrlhf_runs_with_its_import_line_changed(tmp_path):
    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_STYLE_AGENT)
    prompts = {PROMPT: [f"Answer: 7{EOS_TOKEN}"], f"{USER_TOKEN}Add 2 and 5.{ASSISTANT_TOKEN}": [f"Answer: 7{EOS_TOKEN}"]}
    result, _ = episodes(str(agent), prompts, max_length=128)
    for episode in result:
        turns = sum(1 for start, flag in enumerate(episode.response_mask)
                    if flag and (start == 0 or not episode.response_mask[start - 1]))
        assert 2 <= turns <= 4 and episode.reward in (0.0, 1.0)  # max_steps 1-3, done on the step after
        assert set(episode.extra_logs) == {"dummy_scores"}


def test_the_calculator_agent_answers_tool_calls_and_rewards_the_final_answer():
    from importlib import util

    spec = util.spec_from_file_location("calculator", "configs/agents/calculator.py")
    calculator = util.module_from_spec(spec)
    spec.loader.exec_module(calculator)
    assert calculator.calculate("12 * (3 + 4)") == "84" and calculator.calculate("7 // 2") == "3"
    for unsafe in ('__import__("os").system("true")', "().__class__", "x + 1", "9 ** 9 ** 9", "[1] * 10"):
        assert calculator.calculate(unsafe).startswith("error:"), unsafe
    # A call of 489 characters whose product has 4481 digits, which Python refuses to write as a string (it crashed
    # the stage): the model is told it is too large.
    product = "*".join(["10**64"] * 70)
    with pytest.raises(ValueError, match="4300 digits"):
        str(10 ** (64 * 70))
    assert len(product) == 489 and calculator.calculate(product) == "error: the result has more than 4096 bits"
    assert calculator.calculate(" * ".join(["10 ** 64"] * 19)) == "1" + "0" * 1216  # 4040 bits: written back
    assert calculator.calculate("-(2 ** 64) ** 64").startswith("error:")
    assert calculator.calculate("9" * 5000).startswith("error:")  # a literal past the limit itself

    call, answer = "<calculator>3+4</calculator>", f"Answer: 7{EOS_TOKEN}"
    [episode], _ = episodes("configs/agents/calculator.py", {PROMPT: [call, answer]}, max_length=96)
    feedback = ids("<result>7</result>")
    assert episode.response_ids == ids(call) + feedback + ids(answer)
    assert episode.response_mask == [1] * len(ids(call)) + [0] * len(feedback) + [1] * len(ids(answer))
    assert episode.reward == 1.0 and episode.extra_logs == {"tool_calls": 1.0}


BROKEN_STEPS = {
    "raises": ("raise KeyError('label')", "AgentInstance.step raised KeyError: 'label'"),
    "no_done": ("return {'rewards': 1.0, 'environment_feedback': ''}", "AgentInstance.step returned no 'done'"),
    "text_reward": ("return {'rewards': 'good', 'environment_feedback': '', 'done': True}",
                    "AgentInstance.step returned 'rewards' 'good', not a number"),
    "not_a_dict": ("return 1.0", "AgentInstance.step returned float, not a dict"),
    "hangs": ("await asyncio.sleep(3600)", "AgentInstance.step took more than --agent_timeout 0.5 s"),
    "blocks": ("time.sleep(3600)", "AgentInstance.step took more than --agent_timeout 0.5 s"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_STEPS))
def test_a_broken_agent_stops_the_stage_naming_the_file_the_method_and_the_prompt(tmp_path, case):
    body, expected = BROKEN_STEPS[case]
    agent = tmp_path / f"{case}_agent.py"
    agent.write_text(
        "import asyncio\nimport time\n\nfrom stages.rl.agents import AgentInstanceBase, MultiTurnAgentExecutor\n\n\n"
        "class AgentInstance(AgentInstanceBase):\n    def __init__(self):\n        pass\n\n"
        "    async def step(self, states):\n"
        "        if 'Add' not in states['observation_text']:\n"
        "            return {'rewards': 0.0, 'environment_feedback': '', 'done': True}\n"
        f"        {body}\n\n\n"
        "class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n        super().__init__(AgentInstance)\n")
    second = f"{USER_TOKEN}Add 2 and 5.{ASSISTANT_TOKEN}"
    with pytest.raises(AgentError) as error:
        episodes(str(agent), {PROMPT: [f"Answer: 7{EOS_TOKEN}"], second: [f"Answer: 7{EOS_TOKEN}"]}, timeout_s=0.5)
    message = str(error.value)
    assert str(agent) in message and expected in message and "prompt 1: " in message and "Add 2 and 5." in message


def test_an_agent_file_without_an_executor_is_refused(tmp_path):
    agent = tmp_path / "empty_agent.py"
    agent.write_text("X = 1\n")
    with pytest.raises(AgentError, match="the file defines no AgentExecutor"):
        load_agent_executor(str(agent))
    with pytest.raises(AgentError, match="not a Python file"):
        load_agent_executor(str(tmp_path / "missing.py"))


def test_the_presets_agent_and_reward_files_resolve_from_any_working_directory(tmp_path, monkeypatch):
    """Presets name configs/... and stages/... files relative to the project: they load from another folder too
    (a Ray job's working directory, or an installed copy's site-packages)."""
    from stages.rewards import load_reward_source

    monkeypatch.chdir(tmp_path)
    for path in ("configs/agents/calculator.py", "stages/tiny_agent.py"):
        assert type(load_agent_executor(path)).__name__ == "AgentExecutor"
    for path in ("configs/reward_funcs/math_answer.py", "stages/tiny_reward.py"):
        assert load_reward_source(path, 1.0, None) is not None
