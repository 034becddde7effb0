"""Rule and remote rewards (`--remote_rm_url`): a Python file exposing `reward_func`, or an HTTP endpoint.

A reward function takes `(queries, prompts, labels)` — full prompt+response texts, prompt texts, dataset labels —
and returns one float per query. An HTTP endpoint receives `{"query": [...], "prompts": [...], "labels": [...]}`
as JSON and answers `{"rewards": [...]}`.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.request
from pathlib import Path
from typing import Callable

import torch

from stages.launch import StageInputError

RewardFunction = Callable[[list[str], list[str], list[str]], torch.Tensor]


def load_reward_function(location: str) -> RewardFunction:
    if location.startswith(("http://", "https://")):
        return lambda queries, prompts, labels: _post_rewards(location, queries, prompts, labels)
    path = Path(location)
    if not path.is_file():
        # Relative paths also resolve against the project root, so presets work from any working directory.
        path = Path(__file__).resolve().parent.parent / location
    if not path.is_file() or path.suffix != ".py":
        raise StageInputError(f"--remote_rm_url {location}: not an http(s) URL nor a Python file")
    spec = importlib.util.spec_from_file_location(f"reward_module_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "reward_func", None)):
        raise StageInputError(f"--remote_rm_url {location}: the file defines no reward_func(queries, prompts, labels)")
    return module.reward_func


def _post_rewards(url: str, queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor:
    body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        rewards = json.loads(response.read())["rewards"]
    if len(rewards) != len(queries):
        raise ValueError(f"reward endpoint {url} returned {len(rewards)} rewards for {len(queries)} queries")
    return torch.tensor(rewards, dtype=torch.float32)
