"""The operational pieces that need no cluster: step-line parsing, the evaluation report, secret redaction, safe
network settings, the crash-loop count. (The same pieces run for real in test_orchestration, test_deployment
and test_crashes.)"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from prefect.states import Crashed, Running, Scheduled
from secret_patterns import CANARY, HEADER_AND_FIELD_TEXTS, JWT, TOKENS, URL_TEXTS

from flows.full_rlhf import automatic_retries_in_a_row
from flows.server_setup import AUTO_RETRY_MESSAGE
from infra.ray_cluster import (
    TEMP_PARENT,
    TEMP_PREFIX,
    HeadPorts,
    HeadRecord,
    LocalRayHead,
    RayClusterError,
    is_own_temp_dir,
    free_ports,
    job_client,
)
from infra.secrets import RedactingStream, Redactor, is_secret_name
from infra.settings import get_settings
from pipeline.report import learning_curve_png, metrics_table
from tasks.progress import parse_step_line

NO_SUCH_PID = 2**22 + 4242  # above Linux's largest pid_max: signalling it can never reach a process


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


def test_report_shows_the_paired_comparisons_with_their_intervals_in_a_table_of_their_own():
    metrics = {"accuracy": 0.9, "reference_accuracy": 0.5, "prompts": 256, "accuracy_gain_vs_reference": 0.4,
               "accuracy_gain_vs_reference_low": 0.3125, "accuracy_gain_vs_reference_high": 0.4875,
               "win_rate_vs_production": 0.625, "win_rate_vs_production_low": 0.5, "win_rate_vs_production_high": 0.75}
    table = metrics_table(metrics).splitlines()
    assert not [line for line in table[:5] if "_vs_" in line]  # not rows of the per-model table
    assert table[-4:] == ["| paired comparison | value | 95% interval |", "|---|---:|---:|",
                          "| accuracy_gain_vs_reference | 0.4000 | [0.3125, 0.4875] |",
                          "| win_rate_vs_production | 0.6250 | [0.5000, 0.7500] |"]


def test_model_written_markdown_in_the_report_renders_as_text_never_as_an_image_or_a_link():
    """Answers are model output: a markdown image in one was fetched by the browser of whoever opened the report (a
    beacon to any host), a link was clickable, a bare URL autolinked."""
    from markdown_it import MarkdownIt

    from pipeline.report import samples_table

    answer = ("![x](http://203.0.113.9/beacon.png) [claim here](https://evil.example/p) <img src=x> www.evil.example "
              "**bold** `code` | 7")
    samples = [{"prompt": "What is 3 + 4? ![p](http://203.0.113.9/p.png)", "label": "7", "model": model,
                "response": answer, "reward": 1.0} for model in ("policy", "reference")]
    table = samples_table(samples)
    html = MarkdownIt("commonmark").enable("table").render(table)
    assert "<table>" in html and html.count("<tr>") == 2  # the header and one prompt: the pipe stayed in its cell
    assert "<img" not in html and "<a " not in html and "<code>" not in html, html
    assert "**bold**" in html and "<strong>(reward 1.0000)</strong>" in html  # the report's own markup stays
    assert "203.0.113.9/beacon.png" in html and "http:\u200b//" in html and "w\u200bww.evil.example" in html


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


@pytest.mark.parametrize("text", URL_TEXTS)
def test_credentials_in_urls_are_redacted_by_pattern(text):
    redacted = Redactor({}).text(text)  # no variable holds them: the pattern alone finds them
    assert CANARY not in redacted and "[redacted]" in redacted
    assert "rm.internal" in redacted or "10.0.0.5" in redacted or "amazonaws" in redacted


@pytest.mark.parametrize("text, redacted", HEADER_AND_FIELD_TEXTS)
def test_header_values_and_credential_fields_are_redacted_by_pattern(text, redacted):
    assert Redactor({}).text(text) == redacted


def test_common_token_formats_and_more_secret_names_are_redacted():
    text = " ".join(TOKENS.values()) + f" {JWT} hf_short sk-short"
    redacted = Redactor({}).text(text)
    assert not any(token in redacted for token in [*TOKENS.values(), JWT]) and "hf_short sk-short" in redacted
    for name in ("DB_PASSWORD", "PREFECT_API_AUTH_STRING", "DATABASE_URL", "PREFECT_API_DATABASE_CONNECTION_URL",
                 "SMTP_PASSWORD_FILE", "PGPASSWORD", "AZURE_STORAGE_CONNECTION_STRING", "SENTRY_DSN",
                 "GOOGLE_APPLICATION_CREDENTIALS", "MYSQL_PWD", "HF_TOKEN_PATH", "PREFECT_SERVER_API_AUTH_STRING",
                 "OPENAI_APIKEY", "API_KEYS", "DB_PASS", "SSH_PASSPHRASE", "TOKEN", "JWT", "SERVICE_JWT"):  # fmt: skip
        assert is_secret_name(name), name
        assert CANARY not in Redactor({name: CANARY}).text(f"value {CANARY}")
    for name in ("TOKENIZERS_PARALLELISM", "PREFECT_API_URL", "RAY_ADDRESS", "KEYBOARD_LAYOUT", "PASSES",
                 "MAX_TOKENS_PER_BATCH"):
        assert not is_secret_name(name), name
    # A tokenizer's special tokens and counts of tokens are no credentials.
    config = '{"eos_token": "</s>", "pad_token": "<pad>", "max_new_tokens": 64, "tokenizer": "gpt2"}'
    assert Redactor({}).text(config) == config
    # A URL with credentials is secret whatever its variable's name.
    redis = f"redis://:{CANARY}@cache.internal:6379/0"
    assert CANARY not in Redactor({"REDIS_URL": redis}).text(f"connecting to {redis}")
    assert "http://127.0.0.1:4200/api" in Redactor({"PREFECT_API_URL": "http://127.0.0.1:4200/api"}).text(
        "api at http://127.0.0.1:4200/api")


def test_a_stream_redacts_whole_lines_even_when_a_secret_arrives_in_pieces():
    import io

    target = io.StringIO()
    stream = RedactingStream(target, Redactor({"HF_TOKEN": CANARY}))
    stream.write(f"token {CANARY[:5]}")
    stream.write(f"{CANARY[5:]} and http://u:p{CANARY[1:]}@h/\nnext ")
    assert target.getvalue() == "token [redacted HF_TOKEN] and http://[redacted]@h/\n"
    stream.flush()
    assert target.getvalue().endswith("next ")


def test_loggers_that_took_the_streams_before_redaction_are_redacted_too():
    """DeepSpeed's and Ray's loggers keep the stream they were given when imported, before a stage process starts
    redacting: their lines went out with secrets in them. A process that imports them first, then redacts, then
    logs through them and prints."""
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "import deepspeed, ray\n"
        "from deepspeed.utils import logger as ds_logger\n"
        "from infra.secrets import Redactor, redact_streams\n"
        f"redact_streams(Redactor({{'HF_TOKEN': {CANARY!r}}}))\n"
        f"ds_logger.warning('deepspeed says ' + {CANARY!r})\n"
        "ray_logger = logging.getLogger('ray')\n"
        "ray_logger.addHandler(logging.StreamHandler(sys.__stderr__)) if not ray_logger.handlers else None\n"
        f"ray_logger.warning('ray says ' + {CANARY!r})\n"
        f"print('print says', {CANARY!r}, flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-2000:]
    for source in ("deepspeed says", "ray says", "print says"):
        assert f"{source} [redacted HF_TOKEN]" in output, (source, output[-2000:])
    assert CANARY not in output


def test_the_local_ray_head_listens_on_loopback_unless_told_otherwise(monkeypatch):
    for name in ("RLHF_BIND_HOST", "RLHF_RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    settings = get_settings()
    assert (settings.bind_host, settings.ray_auth_mode) == ("127.0.0.1", "disabled")
    loopback = LocalRayHead(bind_host=settings.bind_host)
    assert "--node-ip-address=127.0.0.1" in loopback.command(HeadPorts.pick("127.0.0.1"))
    assert loopback.environment()["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"

    monkeypatch.setenv("RLHF_BIND_HOST", "0.0.0.0")  # exposing the head turns token auth on
    assert get_settings().ray_auth_mode == "token"
    exposed = LocalRayHead(bind_host="0.0.0.0", auth_mode="token")
    assert "--dashboard-host=0.0.0.0" in exposed.command(HeadPorts.pick("0.0.0.0"))
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in exposed.environment()
    assert exposed.environment()["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RLHF_RAY_AUTH_MODE", "disabled")  # an open Jobs API on a network: refused
    with pytest.raises(ValueError, match="RLHF_BIND_HOST=0.0.0.0 exposes the Ray head.*RLHF_RAY_AUTH_MODE=disabled"):
        get_settings()
    monkeypatch.setenv("RLHF_BIND_HOST", "127.0.0.1")
    assert get_settings().ray_auth_mode == "disabled"


def test_a_heads_ports_are_distinct_and_a_start_that_lost_one_retries_on_fresh_ports(monkeypatch):
    for _ in range(50):  # all bound at once: the kernel may hand a closed port to the next bind
        assert len(set(free_ports(7))) == 7
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = []
    pick = HeadPorts.pick

    def first_pick_loses_its_gcs_port(host: str) -> HeadPorts:
        ports = pick(host)
        if not picks:
            ports = HeadPorts(taken.getsockname()[1], *free_ports(6, host))
        picks.append(ports)
        return ports

    monkeypatch.setattr(HeadPorts, "pick", staticmethod(first_pick_loses_its_gcs_port))
    try:
        with LocalRayHead(num_cpus=1) as head:
            assert len(picks) == 2 and head.gcs_address.endswith(f":{picks[1].gcs}")
            # Ray made its temp folder world-writable; the head's own processes alone may use it.
            assert os.stat(head.record().temp_dir).st_mode & 0o777 == 0o700
    finally:
        taken.close()


def head_record(temp_dir: Path) -> HeadRecord:
    return HeadRecord(address="http://127.0.0.1:1", pid=NO_SUCH_PID, create_time=0.0, temp_dir=str(temp_dir),
                      host=socket.gethostname(), owner_pid=NO_SUCH_PID, started_at="")


def test_only_temp_folders_of_our_own_heads_are_ever_removed(tmp_path):
    """A workspace's ray-head.json can be edited by any job: a head adopted from it removes its temp folder only
    when that is one of ours (/tmp/rlhf-ray-*, a real folder of this user)."""
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "data").write_text("keep")
    disguised = TEMP_PARENT / f"{TEMP_PREFIX}{uuid.uuid4().hex}"  # named like ours, pointing elsewhere
    disguised.symlink_to(victim, target_is_directory=True)
    ours = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=TEMP_PARENT))
    try:
        for temp_dir in (victim, disguised, TEMP_PARENT / f"{TEMP_PREFIX}x" / ".." / victim.relative_to("/")):
            LocalRayHead.adopt(head_record(temp_dir)).stop()
            assert (victim / "data").read_text() == "keep", temp_dir
        assert is_own_temp_dir(ours) and not is_own_temp_dir(disguised)
        LocalRayHead.adopt(head_record(ours)).stop()
        assert not ours.exists()
    finally:
        disguised.unlink(missing_ok=True)
        shutil.rmtree(ours, ignore_errors=True)


def test_results_are_refused_inside_the_workspace(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHF_WORKSPACE_ROOT", str(tmp_path / "workspace"))
    monkeypatch.setenv("RLHF_RESULT_STORAGE", str(tmp_path / "workspace" / "prefect-results"))
    with pytest.raises(ValueError, match="inside RLHF_WORKSPACE_ROOT.*every stage job writes"):
        get_settings()
    monkeypatch.setenv("RLHF_RESULT_STORAGE", str(tmp_path / "results"))
    assert get_settings().result_storage == str(tmp_path / "results")


def test_a_result_naming_an_exception_type_outside_the_project_python_and_prefect_is_refused(monkeypatch, tmp_path):
    """Prefect rebuilds a failed task's exception from `__exc_type__`, importing the module it names: a planted
    result naming a module of its choice ran that module's code on the worker. The check refuses it; the exception
    types results hold (this project's, Python's, Prefect's) pass."""
    import sys

    from prefect.results import ResultRecord, ResultRecordMetadata

    from tasks.results import RESULT_SERIALIZER, RefusedResult, check_result_record

    marker = tmp_path / "planted-module-ran"
    (tmp_path / "planted_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Boom(Exception): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def record(error: BaseException) -> bytes:
        return ResultRecord(result=error, metadata=ResultRecordMetadata(serializer=RESULT_SERIALIZER,
                                                                        storage_key="k")).serialize()

    from tasks.run_stage import StageError

    for error in (ValueError("boom"), StageError("stage sft: failed")):
        check_result_record(record(error), "a-result")
    planted = record(ValueError("boom")).replace(b"builtins.ValueError", b"planted_module.Boom")
    with pytest.raises(RefusedResult, match="planted_module.Boom"):
        check_result_record(planted, "a-result")
    bare = b'{"steps": [{"__exc_type__": "planted_module.Boom", "message": "x"}]}'  # a flow's bare result
    with pytest.raises(RefusedResult, match="planted_module.Boom"):
        check_result_record(bare, "a-result")
    with pytest.raises(RefusedResult, match="7"):
        check_result_record(b'{"__exc_type__": 7, "message": "x"}', "a-result")
    assert not marker.exists()
    # What the check stands between: Prefect's own decoding of that record imports the planted module.
    ResultRecord.deserialize(planted)
    assert marker.exists()
    sys.modules.pop("planted_module", None)


class HalfOpenJobsApi:
    """An HTTP server that answers the client's version check, then accepts every other request and never
    answers: a Jobs API behind a connection that died half-open."""

    def __init__(self):
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        release = self.release = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/api/version":
                    body = json.dumps({"version": "4", "ray_version": "2.60.0", "ray_commit": "x"}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    release.wait(120)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_jobs_api_that_stops_answering_fails_the_watch_instead_of_hanging_it(monkeypatch):
    import logging

    from tasks.run_stage import _LogForwarder, _watch

    monkeypatch.setenv("RLHF_RAY_HTTP_TIMEOUT_S", "1")
    api = HalfOpenJobsApi()
    try:
        client = job_client(api.address)
        started = time.monotonic()
        with pytest.raises(RayClusterError, match=f"lost the Ray cluster at {api.address}"):
            _watch(client, api.address, "rlhf-job-1", deadline_s=600, poll_s=0.1, logger=logging.getLogger("test"),
                   logs=_LogForwarder(client, "rlhf-job-1", logging.getLogger("test"), Redactor({}), None))
        assert time.monotonic() - started < 10
    finally:
        api.close()


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


def test_wandb_files_stay_outside_the_output_and_its_config_and_console_are_redacted(tmp_path):
    """A stage process as it runs (its streams redacted, a secret in its environment and in its config) with W&B:
    nothing of W&B lands in the committed output, and neither the config W&B records nor its console capture holds
    the secret."""
    import subprocess
    import sys

    output = tmp_path / "output"
    script = (
        "from infra.secrets import redact_streams\n"
        "redact_streams()\n"
        "from stages.evaluate.config import EvaluateConfig\n"
        "from stages.tracking import StepLog\n"
        f"cfg = EvaluateConfig(save_path={str(output)!r}, use_wandb=True, input_key={CANARY!r})\n"
        "log = StepLog('evaluate', cfg, total_steps=1)\n"
        f"print('the stage prints', {CANARY!r}, flush=True)\n"
        "log.log(1, {'step': 1, 'reward': 0.5})\n"
        "log.close()\n"
    )
    env = {**os.environ, "HF_TOKEN": CANARY, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    env.pop("WANDB_API_KEY", None), env.pop("WANDB_DIR", None)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    written = {path: path.read_bytes() for path in (tmp_path / "output.wandb").rglob("*") if path.is_file()}
    assert written and not output.exists()  # nothing of W&B in what is committed as the artifact
    assert [path for path, data in written.items() if CANARY.encode() in data] == []
    console = [data for path, data in written.items() if b"the stage prints" in data]
    assert console and all(b"[redacted HF_TOKEN]" in data for data in console)  # captured, redacted


@pytest.mark.slow
def test_every_worker_process_of_a_stage_redacts_its_own_log_files(tmp_path):
    """A worker process the stage's code does not set up itself (vLLM's tensor-parallel workers are Ray actors of
    vLLM's) writes its node's log files: Ray's setup hook makes each worker of the stage's cluster redact first."""
    import subprocess
    import sys

    script = (
        "import glob, os, ray\n"
        "from stages.distributed import init_ray\n"
        "init_ray()\n"
        "@ray.remote\n"
        "class Chatty:\n"
        "    def speak(self):\n"
        "        print('the token is', os.environ['REWARD_API_TOKEN'], flush=True)\n"
        "        return os.getpid()\n"
        "chatty = Chatty.remote()\n"
        "pid = ray.get(chatty.speak.remote())\n"
        "logs = ray._private.worker.global_worker.node.get_logs_dir_path()\n"
        "ray.kill(chatty)\n"
        "text = ''.join(open(p, errors='replace').read() for p in glob.glob(f'{logs}/worker-*{pid}.out'))\n"
        "print('LOG:', text.replace(chr(10), ' '))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**env, "REWARD_API_TOKEN": CANARY, "RAY_USAGE_STATS_ENABLED": "0"},
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stdout.split("LOG:", 1)[1]
    assert "the token is [redacted REWARD_API_TOKEN]" in log and CANARY not in log + done.stdout + done.stderr
