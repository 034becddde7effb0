"""The operational pieces that need no cluster: step-line parsing, the evaluation report, secret redaction, safe
network settings, the crash-loop count. (The same pieces run for real in test_orchestration, test_deployment
and test_crashes.)"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from prefect.states import Crashed, Running, Scheduled

from flows.full_rlhf import automatic_retries_in_a_row
from flows.server_setup import AUTO_RETRY_MESSAGE
from infra.ray_cluster import LocalRayHead
from infra.secrets import Redactor, is_secret_name
from infra.settings import get_settings
from tasks.progress import parse_step_line
from pipeline.report import learning_curve_png, metrics_table


def test_step_lines_are_parsed_in_the_stages_format():
    line = "[rl] step 5/25 (20%, elapsed 0:00:12, ETA 0:00:48) reward=0.4100 kl=0.0123"
    progress = parse_step_line(line)
    assert (progress.stage, progress.step, progress.total, progress.percent) == ("rl", 5, 25, 20.0)
    assert (progress.elapsed, progress.eta) == ("0:00:12", "0:00:48")
    assert progress.values == {"reward": "0.4100", "kl": "0.0123"}
    # As it arrives from a rank actor, and without values.
    actor = parse_step_line("(SFTWorker pid=4711) [sft] step 120/360 (33%, elapsed 1:02:03, ETA 2:04:06)")
    assert (actor.stage, actor.step, actor.total, actor.values) == ("sft", 120, 360, {})


@pytest.mark.parametrize("line", [
    "[sft] step=50 loss=0.8123 lr=0.0020",  # today's per-step lines: no progress
    "[rl] resumed from the checkpoint of step 5",
    "[rl] step 5/25 reward=0.41",
    "step 5/25 (20%, elapsed 0:00:12, ETA 0:00:48)",
    "",
])  # fmt: skip
def test_other_lines_show_no_progress(line):
    assert parse_step_line(line) is None


def test_report_table_has_a_production_column_only_when_production_was_scored():
    metrics = {"accuracy": 0.9, "reference_accuracy": 0.125, "reward_mean": 1.5, "reference_reward_mean": -0.25,
               "kl_mean": 0.0312, "prompts": 256}  # fmt: skip
    table = metrics_table(metrics).splitlines()
    assert table[0] == "| metric | policy | reference |"
    assert "| accuracy | 0.9000 | 0.1250 |" in table and "| prompts | 256 | – |" in table

    table = metrics_table({**metrics, "production_accuracy": 0.75, "production_reward_mean": 1.25}).splitlines()
    assert table[0] == "| metric | policy | reference | production |"
    assert "| accuracy | 0.9000 | 0.1250 | 0.7500 |" in table
    assert "| reward_mean | 1.5000 | -0.2500 | 1.2500 |" in table
    assert "| kl_mean | 0.0312 | – | – |" in table


def test_learning_curve_is_a_png_of_the_history():
    history = [{"step": s, "reward": s / 10, "kl": s / 100, "response_length": 4.0} for s in range(1, 6)]
    assert learning_curve_png(history, "tiny/rl v1").startswith(b"\x89PNG\r\n\x1a\n")
    assert learning_curve_png([{"step": 1, "response_length": 4.0}], "nothing to draw") is None


def test_secret_values_are_redacted_by_variable_name():
    env = {"HF_TOKEN": "hf_abcdefgh123", "DB_SECRET_URL": "postgres://u:pw@db/x", "WANDB_API_KEY": "0123456789ab",
           "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE1", "RAY_AUTH_TOKEN": "ray-token-xyz", "AWS_MAX_ATTEMPTS": "3",
           "RLHF_WORKSPACE_ROOT": "/shared/workspace", "TOKENIZERS_PARALLELISM": "false-ish-long"}  # fmt: skip
    redact = Redactor(env)
    text = " ".join(f"{k}={v}" for k, v in env.items())
    redacted = redact.text(text)
    for name in ("HF_TOKEN", "DB_SECRET_URL", "WANDB_API_KEY", "AWS_ACCESS_KEY_ID", "RAY_AUTH_TOKEN"):
        assert env[name] not in redacted and f"{name}=[redacted {name}]" in redacted
    # Short values (counts, flags) and non-secret names stay.
    assert "AWS_MAX_ATTEMPTS=3" in redacted and "/shared/workspace" in redacted and "false-ish-long" in redacted
    assert redact.data({"url": ["x", "postgres://u:pw@db/x"], "n": 3}) == {
        "url": ["x", "[redacted DB_SECRET_URL]"], "n": 3}  # fmt: skip
    assert not is_secret_name("TOKENIZERS_PARALLELISM") and is_secret_name("my_api_key")


def test_the_local_ray_head_listens_on_loopback_unless_told_otherwise(monkeypatch):
    for name in ("RLHF_BIND_HOST", "RLHF_RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    settings = get_settings()
    assert (settings.bind_host, settings.ray_auth_mode) == ("127.0.0.1", "disabled")
    loopback = LocalRayHead(bind_host=settings.bind_host)
    assert "--node-ip-address=127.0.0.1" in loopback.command(8265)
    assert loopback.environment()["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"

    monkeypatch.setenv("RLHF_BIND_HOST", "0.0.0.0")  # exposing the head turns token auth on
    assert get_settings().ray_auth_mode == "token"
    exposed = LocalRayHead(bind_host="0.0.0.0", auth_mode="token")
    assert "--dashboard-host=0.0.0.0" in exposed.command(8265)
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in exposed.environment()
    assert exposed.environment()["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RLHF_RAY_AUTH_MODE", "disabled")  # still possible, but only when said
    assert get_settings().ray_auth_mode == "disabled"


def test_crash_retries_are_counted_since_the_run_was_last_scheduled_by_hand():
    start = datetime(2026, 1, 1, 1, 0, tzinfo=timezone.utc)

    def at(minutes: int, state):
        return state.model_copy(update={"timestamp": start + timedelta(minutes=minutes)})

    auto = Scheduled(name="AwaitingRetry", message=AUTO_RETRY_MESSAGE)
    by_hand = Scheduled(name="AwaitingRetry", message="Retry from the UI")
    history = [at(0, Scheduled()), at(1, Running()), at(2, Crashed()), at(3, auto), at(4, Running()),
               at(5, Crashed()), at(6, auto)]  # fmt: skip
    assert automatic_retries_in_a_row(history) == 2
    history += [at(7, Running()), at(8, Crashed()), at(9, by_hand)]
    assert automatic_retries_in_a_row(history) == 0
