"""A tool-calling agent (`--agent_func_path configs/agents/calculator.py`): the model may write
`<calculator>12 * (3 + 4)</calculator>` and gets `<result>84</result>` back, as often as MAX_CALLS times; a turn
without a call is its final answer, rewarded 1 when the number after `Answer:` (or in `\\boxed{}`) equals the label.

The expression is arithmetic only: numbers, + - * / // % ** and parentheses, parsed with `ast` and evaluated node by
node; no name, call or attribute is ever looked up, so a model cannot run code through it. Change the constants to
fit your prompts (the tags your SFT data uses, the answer pattern)."""

import ast
import math
import operator
import re

from stages.rl.agents import AgentInstanceBase, MultiTurnAgentExecutor

CALL = re.compile(r"<calculator>(.*?)</calculator>", re.DOTALL)
ANSWER = re.compile(r"(?:Answer:\s*|\\boxed\{)\s*(-?[\d.,]+)")
MAX_CALLS = 4
MAX_POWER = 64  # exponents above this are refused: 9 ** 9 ** 9 would hang the stage
MAX_BITS = 4096  # and so is any integer of more bits: ((10 ** 64) ** 64) ** 64 would hang it too, and a product of
# many powers could not even be written back (Python refuses int-to-string conversions of over 4300 digits)
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or an error text the model sees instead."""
    def bounded(result):
        if isinstance(result, int) and result.bit_length() > MAX_BITS:
            raise ValueError(f"the result has more than {MAX_BITS} bits")
        return result

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return bounded(OPERATORS[type(node.op)](value(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > MAX_POWER or (
                    isinstance(left, int) and abs(left) > 1 and abs(left).bit_length() * abs(right) > MAX_BITS)):
                raise ValueError(f"{left} ** {right} is too large")
            return bounded(OPERATORS[type(node.op)](left, right))
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {type(node).__name__}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as error:
        return f"error: {error}"
    if isinstance(result, float):
        return "error: not a finite number" if not math.isfinite(result) else f"{result:.10g}"
    return str(result)


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.calls = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        action = states["action_text"]
        call = CALL.search(action)
        if call and self.calls < MAX_CALLS:
            self.calls += 1
            return {"rewards": 0.0, "scores": 0.0, "environment_feedback": f"<result>{calculate(call.group(1))}</result>",
                    "done": False, "sampling_params": states.get("sampling_params"),
                    "extra_logs": {"tool_calls": float(self.calls)}}
        answer = ANSWER.search(action)
        right = answer is not None and number(answer.group(1)) == number(str(states["label"]))
        return {"rewards": float(right), "scores": float(right), "environment_feedback": "", "done": True,
                "sampling_params": states.get("sampling_params"), "extra_logs": {"tool_calls": float(self.calls)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
