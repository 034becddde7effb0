"""Rule and remote rewards (`--remote_rm_url`): a Python file exposing `reward_func`, or HTTP endpoints.

A reward source is called with `(queries, prompts, labels)` — prompt + response texts, prompt texts, dataset labels
— and answers one reward per query, as a list, a tensor, or a dict `{"rewards": ..., "scores": ..., "extra_logs":
{...}}` (OpenRLHF's format: `scores` drive dynamic filtering and default to the rewards; `extra_logs` values are
averaged into the step metrics). An HTTP endpoint receives `{"query": [...], "prompts": [...], "labels": [...]}` as
JSON and answers the same dict.

A reward function that raises, answers None, the wrong number of values, or a non-finite value is a bug in the
reward, not bad luck: `RewardFunctionError` (the stage exits with code 2) names the function and the bad index.
An endpoint that cannot be reached, times out, cuts its answer short, answers an HTTP error or something that is
not JSON is bad luck: the request is retried with backoff on the next endpoint of the list, and samples whose every
attempt failed come back marked `failed` (the RL stage drops them, never trains on them; the evaluation fails, to
be retried).

Each request has one deadline, `--remote_rm_timeout`, for all of it (connecting, sending, waiting, reading), so an
endpoint that answers a byte at a time cannot hold a step longer; an answer larger than MAX_ANSWER_BYTES is refused
unread, and a redirect is an error, never followed: the Authorization header would go to whatever host it names.

Endpoints that need authentication get an `Authorization` header whose value is read from the environment variable
`--remote_rm_auth_env` names (on the Ray nodes), sent over https only, except to this machine's loopback; a URL that
carries credentials itself (`user:pass@`, `?token=`) is refused with exit 2, its credentials redacted from the
message.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.secrets import is_secret_name, redact_patterns, url_credentials_refusal
from infra.net import is_loopback
from stages.errors import StageInputError

REMOTE_ATTEMPTS = 5
BACKOFF_BASE_S = 0.5  # waits 0.5, 1, 2, 4 s between the attempts of one request
# A reward answer is a few numbers a sample (plus `extra_logs`); 64 MiB holds a million samples with room to spare.
MAX_ANSWER_BYTES = 64 * 2**20


class EndpointAnswerError(OSError):
    """An endpoint answered in a way we do not accept (error status, redirect, too large, past the deadline):
    a failed attempt, like a refused connection."""


def _shut(sock: socket.socket) -> None:
    """End every read and write in progress on `sock`, from another thread."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def post_json(url: str, body: bytes, headers: dict[str, str], deadline_s: float,
              max_bytes: int = MAX_ANSWER_BYTES) -> Any:  # fmt: skip
    """POST `body` to `url` and parse the JSON answer, all of it within `deadline_s`: a timer shuts the socket at
    the deadline, which ends any read in progress (a socket timeout alone restarts at every byte received)."""
    started = time.monotonic()
    parts = urllib.parse.urlsplit(url)
    connection_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    connection = connection_type(parts.hostname, parts.port, timeout=deadline_s)
    expired, timer = threading.Event(), None
    try:
        connection.connect()  # bounded by the socket timeout; the timer takes over from here
        # The response keeps reading from this socket after the connection lets go of it (HTTP/1.0, `close`).
        sock = connection.sock
        timer = threading.Timer(max(deadline_s - (time.monotonic() - started), 0.0),
                                lambda: (expired.set(), _shut(sock)))  # fmt: skip
        timer.start()
        connection.request("POST", urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                           body=body, headers=headers)  # fmt: skip
        response = connection.getresponse()
        if 300 <= response.status < 400:
            raise EndpointAnswerError(f"answered {response.status} redirecting to "
                                      f"{redact_patterns(str(response.getheader('Location')))}: "
                                      "redirects are not followed (the Authorization header would go along)")
        if response.status >= 400:
            raise EndpointAnswerError(f"answered HTTP {response.status} {response.reason}")
        declared = response.getheader("Content-Length")
        if declared is not None and declared.isdigit():
            if int(declared) > max_bytes:
                raise EndpointAnswerError(f"answer of {int(declared)} bytes refused: over the {max_bytes}-byte limit")
            payload = response.read()  # all it declared, or IncompleteRead
        else:
            payload = response.read(max_bytes + 1)
            if len(payload) > max_bytes:
                raise EndpointAnswerError(f"answer refused: over the {max_bytes}-byte limit")
        if expired.is_set():
            raise TimeoutError
        return json.loads(payload)
    except (OSError, http.client.HTTPException) as error:
        if expired.is_set() and not isinstance(error, EndpointAnswerError):
            raise TimeoutError(f"no complete answer within the {deadline_s:g} s deadline") from error
        raise
    finally:
        if timer is not None:
            timer.cancel()
        connection.close()


class RewardFunctionError(StageInputError):
    """A reward source answered something unusable (exit 2: rerunning cannot fix it)."""


@dataclass
class RewardBatch:
    """Rewards of B samples. `failed` samples have NaN rewards and must not be trained on."""

    rewards: torch.Tensor
    scores: torch.Tensor
    failed: torch.Tensor
    extra_logs: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @classmethod
    def concat(cls, batches: list[RewardBatch]) -> RewardBatch:
        weights = [int((~b.failed).sum()) for b in batches]
        extra: dict[str, float] = {}
        for key in {k for b in batches for k in b.extra_logs}:
            pairs = [(b.extra_logs[key], w) for b, w in zip(batches, weights) if key in b.extra_logs and w]
            if pairs:
                extra[key] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
        return cls(torch.cat([b.rewards for b in batches]), torch.cat([b.scores for b in batches]),
                   torch.cat([b.failed for b in batches]), extra, [e for b in batches for e in b.errors])


def _as_values(value: Any, expected: int, source: str, what: str) -> torch.Tensor:
    if value is None:
        raise RewardFunctionError(f"{source} returned None for {what} of {expected} samples")
    try:
        if isinstance(value, torch.Tensor):
            values = value.detach().to("cpu", torch.float32)
        else:
            values = torch.as_tensor(np.asarray(value, dtype=np.float64), dtype=torch.float32)
    except (TypeError, ValueError, RecursionError) as error:
        raise RewardFunctionError(f"{source} returned {what} that are not numbers: {str(error)[:200]}") from None
    if values.dim() == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.dim() != 1 or values.numel() != expected:
        raise RewardFunctionError(
            f"{source} returned {what} of shape {tuple(values.shape)} for {expected} samples: expected one value "
            "per query"
        )
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        raise RewardFunctionError(
            f"{source} returned non-finite {what} ({values[bad[0]].item()}) at index {bad[0]}"
            + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
        )
    return values


def parse_reward_output(output: Any, expected: int, source: str) -> RewardBatch:
    """Rewards (and scores, extra logs) from what a reward function or endpoint answered, checked."""
    extra_logs: dict[str, float] = {}
    if isinstance(output, dict):
        if "rewards" not in output:
            raise RewardFunctionError(f"{source} returned a dict without 'rewards' (keys: {sorted(output)})")
        rewards = _as_values(output["rewards"], expected, source, "rewards")
        scores = (_as_values(output["scores"], expected, source, "scores") if output.get("scores") is not None
                  else rewards.clone())
        logs = output.get("extra_logs") or {}
        if not isinstance(logs, dict):
            raise RewardFunctionError(f"{source} returned 'extra_logs' of type {type(logs).__name__}, not a dict of "
                                      "numbers")
        for key, value in logs.items():
            try:
                values = torch.as_tensor(np.asarray(value, dtype=np.float64)).float().flatten()
            except (TypeError, ValueError, RecursionError):
                raise RewardFunctionError(f"{source} returned extra_logs[{str(key)[:80]!r}] that is not a number or "
                                          "a list of numbers") from None
            if values.numel():
                extra_logs[str(key)] = float(values.mean())
    else:
        rewards = _as_values(output, expected, source, "rewards")
        scores = rewards.clone()
    return RewardBatch(rewards, scores, torch.zeros(expected, dtype=torch.bool), extra_logs)


class RewardFunction:
    """`reward_func(queries, prompts, labels)` from a Python file."""

    def __init__(self, path: Path):
        spec = importlib.util.spec_from_file_location(f"reward_module_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:
            raise RewardFunctionError(f"--remote_rm_url {path}: importing it failed: {type(error).__name__}: "
                                      f"{error}") from error
        self.function = getattr(module, "reward_func", None)
        if not callable(self.function):
            raise RewardFunctionError(f"--remote_rm_url {path}: the file defines no "
                                      "reward_func(queries, prompts, labels)")
        self.name = f"reward_func in {path}"

    def __call__(self, queries: list[str], prompts: list[str], labels: list[str]) -> RewardBatch:
        try:
            output = self.function(queries, prompts, labels)
        except Exception as error:
            raise RewardFunctionError(f"{self.name} raised {type(error).__name__}: {error}") from error
        return parse_reward_output(output, len(queries), self.name)


class RemoteReward:
    """HTTP reward endpoints: the batch is split over them; a failed request moves on to the next endpoint."""

    def __init__(self, urls: list[str], timeout_s: float, backoff_base_s: float = BACKOFF_BASE_S,
                 headers: dict[str, str] | None = None):  # fmt: skip
        self.urls = urls
        self.timeout_s = timeout_s
        self.backoff_base_s = backoff_base_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.name = f"reward endpoint{'s' if len(urls) > 1 else ''} {', '.join(urls)}"

    def __call__(self, queries: list[str], prompts: list[str], labels: list[str]) -> RewardBatch:
        if not queries:
            return parse_reward_output([], 0, self.name)
        per_chunk = math.ceil(len(queries) / len(self.urls))
        starts = range(0, len(queries), per_chunk)
        with ThreadPoolExecutor(max_workers=len(starts)) as pool:
            parts = pool.map(lambda item: self._request(item[0], queries[item[1] : item[1] + per_chunk],
                                                        prompts[item[1] : item[1] + per_chunk],
                                                        labels[item[1] : item[1] + per_chunk]),
                             enumerate(starts))
            return RewardBatch.concat(list(parts))

    def _request(self, chunk: int, queries: list[str], prompts: list[str], labels: list[str]) -> RewardBatch:
        body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        errors = []
        for attempt in range(REMOTE_ATTEMPTS):
            url = self.urls[(chunk + attempt) % len(self.urls)]
            if attempt:
                time.sleep(self.backoff_base_s * 2 ** (attempt - 1))
            try:
                answer = post_json(url, body, self.headers, self.timeout_s)
            # refused, reset, timed out, cut short (IncompleteRead, BadStatusLine), an HTTP error status, not JSON
            # (or JSON nested deeper than the decoder recurses)
            except (OSError, ValueError, RecursionError, http.client.HTTPException) as error:
                errors.append(f"{url}: {type(error).__name__}: {error}")
                continue
            return parse_reward_output(answer, len(queries), f"reward endpoint {url}")
        failed = torch.ones(len(queries), dtype=torch.bool)
        nan = torch.full((len(queries),), math.nan)
        return RewardBatch(nan, nan.clone(), failed, {}, errors)


def load_reward_source(spec: str, timeout_s: float = 180.0, auth_env: str | None = None,
                       ) -> RewardFunction | RemoteReward:  # fmt: skip
    """`--remote_rm_url`: a comma-separated list of http(s) URLs (with `auth_env`, the variable holding their
    Authorization header), or a Python file defining reward_func."""
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if parts and all(part.startswith(("http://", "https://")) for part in parts):
        if refusal := url_credentials_refusal("--remote_rm_url", spec):  # the config refuses it first
            raise StageInputError(refusal)
        if auth_env:
            for url in parts:
                if url.startswith("http://") and not is_loopback(urllib.parse.urlsplit(url).hostname or ""):
                    raise StageInputError(
                        f"--remote_rm_url {url}: --remote_rm_auth_env {auth_env} would send its credentials "
                        "unencrypted to another machine; use https (plain http is allowed to loopback only)")
        return RemoteReward(parts, timeout_s, headers=auth_header(auth_env))
    if auth_env:
        raise StageInputError(f"--remote_rm_auth_env {auth_env}: applies to HTTP reward endpoints, and "
                              f"--remote_rm_url {spec} is none")
    path = project_file(spec)
    if not path.is_file() or path.suffix != ".py":
        raise StageInputError(f"--remote_rm_url {redact_patterns(spec)}: not http(s) URLs nor a Python file")
    return RewardFunction(path)


def project_file(spec: str) -> Path:
    """A reward or agent file named by a flag: the path itself, or else the same relative path under the folder
    that holds the project's packages (the checkout, or site-packages when installed), so presets naming
    configs/... or stages/... work from any working directory."""
    path = Path(spec)
    return path if path.is_file() else Path(__file__).resolve().parent.parent / spec


def reward_source_of(cfg) -> RewardFunction | RemoteReward | None:
    """The reward source of an RL or evaluation config (--remote_rm_url), or None when it scores with a model."""
    if not cfg.remote_rm_url:
        return None
    return load_reward_source(cfg.remote_rm_url, cfg.remote_rm_timeout, cfg.remote_rm_auth_env)


def auth_header(variable: str | None) -> dict[str, str]:
    """{"Authorization": value of `variable`} (none without one). The variable must be named as a secret
    (`*_TOKEN`, `*_KEY`, ...), so that its value is redacted wherever it could be printed."""
    if not variable:
        return {}
    if not is_secret_name(variable):
        raise StageInputError(f"--remote_rm_auth_env {variable}: name the variable as a secret (e.g. "
                              f"REWARD_API_TOKEN, *_TOKEN, *_KEY), so that its value is redacted from every log")
    value = os.environ.get(variable)
    if not value:
        raise StageInputError(f"--remote_rm_auth_env {variable}: the variable is not set in this process's "
                              "environment (give it to the Ray nodes, not to the config)")
    return {"Authorization": value}
