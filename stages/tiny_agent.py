"""The tiny task with a second try, as an agent (`--agent_func_path stages/tiny_agent.py`): a wrong first answer
is told whether the sum is more or less, and the model answers again. An episode succeeds (reward 1) when one of
its two answers is the sum; `first_try` logs how often the first one was."""

from stages.rl.agents import AgentInstanceBase, MultiTurnAgentExecutor
from stages.tiny import ASSISTANT_TOKEN, USER_TOKEN, extract_answer

TRIES = 2


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.tries += 1
        answer, label = extract_answer(states["action_text"]), int(states["label"])
        right = answer is not None and int(answer) == label
        done = right or self.tries >= TRIES
        direction = "more" if answer is None or int(answer) < label else "less"
        return {
            "rewards": 1.0 if right else 0.0,
            "scores": 1.0 if right else 0.0,
            # A new user turn, then the assistant's again (the tiny chat template's layout).
            "environment_feedback": "" if done else f"{USER_TOKEN}No, {direction}.{ASSISTANT_TOKEN}",
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"first_try": 1.0 if right and self.tries == 1 else 0.0},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
