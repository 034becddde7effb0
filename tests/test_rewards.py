"""Reward sources: what a reward function may answer, what stops a stage, and HTTP endpoints that fail."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from stages.rewards import (
    REMOTE_ATTEMPTS,
    RemoteReward,
    RewardFunction,
    RewardFunctionError,
    load_reward_source,
    parse_reward_output,
    post_json,
)
from stages.errors import StageInputError

from infra.ray_cluster import free_port
from reward_server import RewardServer

QUERIES = ["1 + 1 = ? Answer: 2", "2 + 2 = ? Answer: 5", "3 + 4 = ? Answer: 7", "0 + 0 = ? Answer: 1"]
PROMPTS = ["1 + 1 = ?", "2 + 2 = ?", "3 + 4 = ?", "0 + 0 = ?"]
LABELS = ["2", "4", "7", "0"]


def test_rewards_come_as_a_list_a_tensor_or_openrlhfs_dict():
    assert parse_reward_output([1, 0.5], 2, "f").rewards.tolist() == [1.0, 0.5]
    assert parse_reward_output(torch.tensor([[1.0], [0.0]]), 2, "f").rewards.tolist() == [1.0, 0.0]
    batch = parse_reward_output({"rewards": torch.tensor([1.0, 0.0]), "scores": [0.3, 0.2],
                                 "extra_logs": {"format_ok": [1.0, 0.0], "length": 3}}, 2, "f")
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.scores.tolist() == pytest.approx([0.3, 0.2])
    assert batch.extra_logs == {"format_ok": 0.5, "length": 3.0}
    assert not batch.failed.any()
    # Without scores, dynamic filtering reads the rewards.
    assert parse_reward_output({"rewards": [2.0]}, 1, "f").scores.tolist() == [2.0]


@pytest.mark.parametrize(
    "output, message",
    [
        (None, "returned None"),
        ([1.0, 0.0, 1.0], "shape (3,) for 4 samples"),
        ([1.0, 0.0, math.nan, 1.0], "non-finite rewards (nan) at index 2"),
        ([1.0, None, 1.0, 0.0], "non-finite rewards (nan) at index 1"),
        ([1.0, math.inf, math.inf, 0.0], "at index 1 and 1 more"),
        (["yes", "no", "no", "no"], "not numbers"),
        ({"score": [1, 1, 1, 1]}, "without 'rewards'"),
        ({"rewards": [1, 1, 1, 1], "scores": [1, 1]}, "scores of shape (2,)"),
        ({"rewards": [1, 1, 1, 1], "extra_logs": {"x": "abc"}}, "extra_logs['x'] that is not a number or a list"),
        ({"rewards": [1, 1, 1, 1], "extra_logs": {"x": [[1], [2, 3]]}}, "extra_logs['x'] that is not a number"),
        ({"rewards": [1, 1, 1, 1], "extra_logs": [1]}, "'extra_logs' of type list, not a dict of numbers"),
        ({"rewards": json.loads("[" * 900 + "]" * 900)}, "rewards that are not numbers"),
    ],
)
def test_unusable_reward_answers_name_the_source_and_the_index(output, message):
    with pytest.raises(RewardFunctionError) as error:
        parse_reward_output(output, 4, "reward_func in r.py")
    assert "reward_func in r.py" in str(error.value) and message in str(error.value)


def test_a_reward_function_that_raises_is_named(tmp_path):
    path = tmp_path / "broken_reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return {'rewards': [1 / 0 for _ in queries]}\n")
    with pytest.raises(RewardFunctionError, match=r"reward_func in .*broken_reward.py raised ZeroDivisionError"):
        RewardFunction(path)(QUERIES, PROMPTS, LABELS)


def test_reward_sources_are_parsed_from_the_flag(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("def reward_func(queries, prompts, labels):\n    return [float(len(q)) for q in queries]\n")
    assert load_reward_source(str(path))(["ab", "c"], ["", ""], ["", ""]).rewards.tolist() == [2.0, 1.0]
    remote = load_reward_source("http://a:1/r, https://b:2/r", timeout_s=3)
    assert isinstance(remote, RemoteReward) and remote.urls == ["http://a:1/r", "https://b:2/r"]
    assert remote.timeout_s == 3
    with pytest.raises(RewardFunctionError, match="no reward_func"):
        (tmp_path / "empty.py").write_text("x = 1\n")
        load_reward_source(str(tmp_path / "empty.py"))
    with pytest.raises(ValueError, match="not http"):
        load_reward_source("reward.txt")


@pytest.fixture
def servers():
    started: list[RewardServer] = []

    def start(**kwargs) -> RewardServer:
        started.append(RewardServer(**kwargs))
        return started[-1]

    yield start
    for server in started:
        server.close()


EXPECTED = [1.0, 0.0, 1.0, 0.0]


def test_a_batch_is_split_over_the_endpoints_in_order(servers):
    a, b = servers(), servers()
    batch = RemoteReward([a.url, b.url], timeout_s=5)(QUERIES, PROMPTS, LABELS)
    assert batch.rewards.tolist() == EXPECTED and not batch.failed.any()
    assert a.requests == [2] and b.requests == [2]


def test_an_endpoint_that_is_down_fails_over_to_the_next(servers):
    up = servers()
    down = f"http://127.0.0.1:{free_port()}/get_reward"
    batch = RemoteReward([down, up.url], timeout_s=5, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.rewards.tolist() == EXPECTED and not batch.failed.any()
    assert sum(up.requests) == 4  # both halves, one of them after the refused attempt on `down`


def test_a_slow_endpoint_times_out_and_fails_over(servers):
    slow, fast = servers(delay_s=3.0), servers()
    started = time.monotonic()
    batch = RemoteReward([slow.url, fast.url], timeout_s=0.5, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.rewards.tolist() == EXPECTED and time.monotonic() - started < 3.0


def test_samples_whose_endpoints_all_fail_come_back_failed_not_scored():
    down = [f"http://127.0.0.1:{free_port()}/r" for _ in range(2)]
    batch = RemoteReward(down, timeout_s=1, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.failed.all() and torch.isnan(batch.rewards).all()
    assert len(batch.errors) == 2 * REMOTE_ATTEMPTS and "Connection refused" in batch.errors[0]  # each attempt


def test_an_endpoint_answering_the_wrong_length_stops_the_stage(servers):
    wrong = servers(answer={"rewards": [1.0]})
    with pytest.raises(RewardFunctionError, match=r"reward endpoint http://127.0.0.1:\d+/get_reward returned rewards "
                                                   r"of shape \(1,\) for 4 samples"):
        RemoteReward([wrong.url], timeout_s=5)(QUERIES, PROMPTS, LABELS)


@pytest.mark.parametrize("misbehave", ["truncated", "not json", "nested"])
def test_an_answer_cut_short_or_not_json_fails_over_to_the_next_endpoint(servers, misbehave):
    broken, good = servers(misbehave=misbehave), servers()
    batch = RemoteReward([broken.url, good.url], timeout_s=5, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.rewards.tolist() == EXPECTED and not batch.failed.any()
    assert broken.requests and sum(good.requests) == 4


def test_an_answer_cut_short_everywhere_marks_the_samples_failed():
    import http.client

    from stages.rewards import RemoteReward as Remote

    server = RewardServer(misbehave="truncated")
    try:
        batch = Remote([server.url], timeout_s=5, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    finally:
        server.close()
    assert batch.failed.all() and "IncompleteRead" in batch.errors[0]
    assert issubclass(http.client.IncompleteRead, http.client.HTTPException)  # not an OSError: caught apart


def test_endpoints_authenticate_with_a_header_from_a_variable_never_from_the_config(servers, monkeypatch):
    secret = "Bearer s3cr3t-t0ken-for-rewards"
    endpoint = servers(token=secret)
    monkeypatch.setenv("REWARD_API_TOKEN", secret)
    source = load_reward_source(endpoint.url, timeout_s=5, auth_env="REWARD_API_TOKEN")
    assert source(QUERIES, PROMPTS, LABELS).rewards.tolist() == EXPECTED
    assert endpoint.authorizations == [secret] and secret not in source.name
    with pytest.raises(StageInputError, match="not set in this process's environment"):
        load_reward_source(endpoint.url, auth_env="MISSING_API_TOKEN")
    with pytest.raises(ValueError, match="name the variable as a secret"):
        load_reward_source(endpoint.url, auth_env="REWARD_HEADER")  # its value would not be redacted
    unauthenticated = load_reward_source(endpoint.url, timeout_s=5)
    unauthenticated.backoff_base_s = 0.01
    assert unauthenticated(QUERIES, PROMPTS, LABELS).failed.all()  # 401: counted as a failed request


@pytest.mark.parametrize("url", ["http://user:CANARY-pw@127.0.0.1:1/r", "http://127.0.0.1:1/r?token=CANARY-tok",
                                 "http://127.0.0.1:1/r,https://h/r?api_key=CANARY-key"])
def test_urls_with_credentials_are_refused_without_showing_them(url, tmp_path, capsys):
    with pytest.raises(ValueError, match="credentials in the URL are refused") as refused:
        load_reward_source(url)
    assert "CANARY" not in str(refused.value) and "--remote_rm_auth_env" in str(refused.value)
    assert isinstance(refused.value, StageInputError)
    # The stage's flags are refused the same way, before its checkpoint folder's fingerprint could store the URL.
    from stages.cli import parse_stage_args
    from stages.registry import STAGES

    with pytest.raises(SystemExit) as stopped:
        parse_stage_args(STAGES["rl"], ["--config", "tiny", "--pretrain", "m", "--prompt_data", "p.jsonl",
                                        "--remote_rm_url", url, "--ckpt_path", str(tmp_path / "ckpt")])
    assert stopped.value.code == 2 and not (tmp_path / "ckpt").exists()
    said = capsys.readouterr()
    assert "credentials in the URL are refused" in said.err and "CANARY" not in said.err + said.out


def test_a_redirect_is_not_followed_and_the_credentials_stay_with_the_endpoint(servers, monkeypatch):
    secret = "Bearer s3cr3t-t0ken-for-rewards"
    elsewhere = servers()
    redirecting = servers(redirect_to=elsewhere.url)
    monkeypatch.setenv("REWARD_API_TOKEN", secret)
    source = load_reward_source(redirecting.url, timeout_s=5, auth_env="REWARD_API_TOKEN")
    source.backoff_base_s = 0.01
    batch = source(QUERIES, PROMPTS, LABELS)
    assert batch.failed.all() and elsewhere.requests == [] and redirecting.authorizations == [secret] * REMOTE_ATTEMPTS
    assert f"answered 307 redirecting to {elsewhere.url}: redirects are not followed" in batch.errors[0]


def test_the_timeout_is_a_deadline_for_the_whole_answer(servers):
    dripping, good = servers(misbehave="drip"), servers()  # its answer would take about 6 s
    started = time.monotonic()
    batch = RemoteReward([dripping.url, good.url], timeout_s=1, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.rewards.tolist() == EXPECTED and time.monotonic() - started < 3.0
    alone = RemoteReward([dripping.url], timeout_s=0.5, backoff_base_s=0.01)(QUERIES[:1], PROMPTS[:1], LABELS[:1])
    assert alone.failed.all() and "no complete answer within the 0.5 s deadline" in alone.errors[0]


def test_an_answer_over_the_size_limit_is_refused_unread(servers):
    huge = servers(misbehave="huge")  # announces 200 MiB
    batch = RemoteReward([huge.url], timeout_s=5, backoff_base_s=0.01)(QUERIES, PROMPTS, LABELS)
    assert batch.failed.all() and f"answer of {200 * 2**20} bytes refused: over the" in batch.errors[0]
    with pytest.raises(OSError, match="over the 10-byte limit"):  # what it sends, not only what it announces
        post_json(servers(misbehave="unsized").url, b'{"query": ["q"], "prompts": ["p"], "labels": ["1"]}', {}, 5, max_bytes=10)


def test_credentials_go_over_https_except_to_loopback(monkeypatch):
    monkeypatch.setenv("REWARD_API_TOKEN", "Bearer s3cr3t-t0ken-for-rewards")
    with pytest.raises(StageInputError, match=r"--remote_rm_url http://rewards.example.com/r: --remote_rm_auth_env "
                                              r"REWARD_API_TOKEN would send its credentials unencrypted"):
        load_reward_source("https://a.example.com/r,http://rewards.example.com/r", auth_env="REWARD_API_TOKEN")
    assert load_reward_source("https://rewards.example.com/r", auth_env="REWARD_API_TOKEN").urls
    assert load_reward_source("http://127.0.0.1:8000/r", auth_env="REWARD_API_TOKEN").urls
    assert load_reward_source("http://rewards.example.com/r").urls  # no credentials: plain http is the user's call
