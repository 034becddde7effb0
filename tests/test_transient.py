"""Outages and refusals of S3 and the hub, the same way for everything that reads from them: data loading, the
artifact store and model downloads. A blip is retried and passes; an outage that outlasts the retries fails in a
way the orchestration retries (exit 1); a refusal (403, 404) fails at once, never retried (exit 2)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import s3fs
from conftest import MOTO_BUCKET
from faulty_http import HUB_REVISION, FaultyEndpoint, hub_answer

from infra.artifacts import is_transient, open_store
from stages.errors import exit_code

ROOT = Path(__file__).resolve().parent.parent
RETRY_S = 4  # RLHF_ARTIFACT_RETRY_S of these tests: an outage outlasts it, a blip does not
# The S3 outage's window: room for a retry even when the first request alone takes over 3 s (a loaded CI machine did).
S3_OUTAGE_RETRY_S = 8

# In a process of its own: the hub's address is read when huggingface_hub is imported.
HUB_OPERATION = """
import sys
from stages.errors import exit_code
operation, source = sys.argv[1:]
try:
    if operation == "pin":
        from stages.fingerprint import pin_hub_revision
        print(pin_hub_revision(source))
    elif operation == "pin model":
        from stages.fingerprint import pin_hub_model
        print(pin_hub_model(source))
    elif operation == "plan pins":
        from pipeline.config import load_pipeline_config
        from pipeline.plan import pin_hub_sources
        config = load_pipeline_config("tiny").model_copy(deep=True)
        config.sft.pretrain = config.reward_model.pretrain = source
        pinned, unpinned = pin_hub_sources(config, [], [], must_pin=True)
        print(pinned.sft.pretrain, pinned.reward_model.pretrain)
    elif operation == "plan hub down":
        from pipeline.config import load_pipeline_config
        from pipeline.plan import model_shape, pin_hub_sources
        from stages.fingerprint import hub_outage_remembered, pin_hub_revision
        config = load_pipeline_config("tiny").model_copy(deep=True)
        config.sft.pretrain, config.sft.dataset, config.reward_model.dataset = source, "org/sft", "org/prefs"
        notes = []
        with hub_outage_remembered():  # as build_plan runs
            pin_hub_sources(config, [], notes, must_pin=False)
            try:
                model_shape(source)
            except Exception as error:
                notes.append(f"{type(error).__name__}: {error}")
        try:  # another plan (a retry of the flow's preflight) asks again
            pin_hub_revision("org/later")
        except Exception as error:
            notes.append(f"{type(error).__name__}: {error}")
        print("\\n".join(notes))
    elif operation == "load model":
        from stages.model_io import load_tokenizer, resolve_model_path
        from transformers import AutoModelForCausalLM
        local = resolve_model_path(source)
        AutoModelForCausalLM.from_pretrained(local)
        load_tokenizer(source)
        print(local)
    else:
        from stages.data import load_rows
        load_rows(source)
except Exception as error:
    print(f"{type(error).__name__}: {error}")
    sys.exit(exit_code(error))
"""


@pytest.fixture(scope="module")
def s3_objects(moto_s3, tmp_path_factory):
    """A prompt dataset and a committed model version on moto, written straight to it."""
    root = f"s3://{MOTO_BUCKET}/{uuid.uuid4().hex}"
    fs = s3fs.S3FileSystem(endpoint_url=moto_s3, key="testing", secret="testing", skip_instance_cache=True)
    fs.pipe_file(f"{root}/data/prompts.jsonl".removeprefix("s3://"),
                 b"".join(json.dumps({"prompt": f"{i} + 1 = ?", "label": str(i + 1)}).encode() + b"\n"
                          for i in range(4)))  # fmt: skip
    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", moto_s3)
        env.setenv("AWS_ENDPOINT_URL_S3", moto_s3)
        store = open_store(f"{root}/artifacts", "pipe")
        version = store.commit("sft", model, config={})
        store.set_alias("sft", "production", version.version)
    return {"root": root, "model": version.uri}


@pytest.fixture
def s3_through_faults(moto_s3, monkeypatch):
    endpoint = FaultyEndpoint(upstream=moto_s3.removeprefix("http://"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint.url)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's own retries off: ours are the ones tested
    monkeypatch.setenv("RLHF_ARTIFACT_RETRY_S", str(RETRY_S))
    yield endpoint
    endpoint.close()


def read_s3_dataset(objects, tmp_path):
    from stages.data import load_rows

    return len(load_rows(f"{objects['root']}/data/prompts.jsonl"))


def read_store(objects, tmp_path):
    return open_store(f"{objects['root']}/artifacts", "pipe").get("sft", "production").version  # alias, manifest


def download_model(objects, tmp_path):
    from stages.model_io import check_model_inputs
    from stages.sft.config import SFTConfig

    check_model_inputs("sft", SFTConfig(pretrain=objects["model"]))
    return "checked"


S3_OPERATIONS = {"dataset on S3": read_s3_dataset, "artifact store on S3": read_store,
                 "model from the store on S3": download_model}


def verdict(operation: str, error: BaseException) -> int:
    """What the orchestration makes of the failure: a stage's exit code; for the store (the worker's), 1 when the
    task's retry can help, 2 when it cannot."""
    if operation == "artifact store on S3":
        return 1 if is_transient(error) else 2
    return exit_code(error)


@pytest.mark.parametrize("operation", S3_OPERATIONS)
# A blip of one failed request: its retry comes 1 s later, well inside RETRY_S on a loaded machine (two would take
# 1 + 2 s of back-off, near it).
@pytest.mark.parametrize(("status", "times", "expected"), [(503, 1, 0), (500, None, 1), (403, None, 2)],
                         ids=["blip", "outage", "denied"])
def test_s3_blips_are_retried_outages_fail_retryably_refusals_at_once(s3_objects, s3_through_faults, tmp_path,
                                                                      monkeypatch, operation, status, times, expected):
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "cache"))  # every model check downloads
    if expected == 1:
        monkeypatch.setenv("RLHF_ARTIFACT_RETRY_S", str(S3_OUTAGE_RETRY_S))
    s3_through_faults.fail(status, times)
    try:
        S3_OPERATIONS[operation](s3_objects, tmp_path)
        outcome = 0
    except Exception as error:  # noqa: BLE001 - the test classifies whatever comes
        outcome = verdict(operation, error)
    assert outcome == expected, (operation, status)
    # Requests the endpoint failed: a refusal's one (never retried), the blip's one (then the retry passed), an
    # outage's every retry.
    assert s3_through_faults.failed == 1 if expected != 1 else s3_through_faults.failed >= 2, s3_through_faults.failed


@pytest.fixture
def hub():
    endpoint = FaultyEndpoint(answer=hub_answer)
    yield endpoint
    endpoint.close()  # again, for a test that closed it already: harmless


def run_on_hub(hub, tmp_path, operation: str, source: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "RLHF_ARTIFACT_RETRY_S": str(RETRY_S), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-c", HUB_OPERATION, operation, source], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize(("operation", "source", "pinned"), [
    ("pin", "org/prompts@test", f"org/prompts#{HUB_REVISION}@test"),  # the revision the job reads, split kept
    ("pin model", "org/policy", f"org/policy#{HUB_REVISION}"),
], ids=["dataset", "model"])  # fmt: skip
@pytest.mark.parametrize(("status", "times", "expected"), [(503, 2, 0), (503, None, 1), (404, None, 2)],
                         ids=["blip", "outage", "no such repository"])
def test_a_hub_revision_look_up_is_retried_and_pins_the_revision(hub, tmp_path, status, times, expected, operation,
                                                                 source, pinned):  # fmt: skip
    hub.fail(status, times)
    done = run_on_hub(hub, tmp_path, operation, source)
    assert done.returncode == expected, done.stdout + done.stderr
    if expected == 0:  # what the plan puts in the stage's config, so in its key
        assert done.stdout.strip() == pinned
    if expected == 1:
        assert "HubUnavailable" in done.stdout  # never a fingerprint that stands in for the revision


def test_the_plan_pins_the_first_stages_hub_model_and_leaves_the_ones_earlier_stages_fill(hub, tmp_path):
    planned = run_on_hub(hub, tmp_path, "plan pins", "org/policy")  # sft.pretrain, reward_model.pretrain
    assert planned.stdout.split() == [f"org/policy#{HUB_REVISION}", "org/policy"], planned.stdout + planned.stderr


def test_a_hub_that_does_not_answer_is_waited_for_once_per_plan_not_once_per_name(hub, tmp_path):
    hub.fail(503)
    done = run_on_hub(hub, tmp_path, "plan hub down", "org/policy")
    out = done.stdout
    assert out.startswith("sft.dataset: hub dataset org/sft: revision look-up"), out + done.stderr
    after = "the hub did not answer the look-up of hub dataset org/sft a moment ago"
    assert f"\nsft.pretrain: hub model org/policy: not looked up: {after}" in out
    assert f"\nreward_model.dataset: hub dataset org/prefs: not looked up: {after}" in out
    assert f"\nHubUnavailable: hub model org/policy: config.json not fetched: {after}\n" in out
    assert "\nHubUnavailable: hub dataset org/later: revision look-up of hub dataset org/later" in out
    assert 2 <= hub.failed <= 6  # the tries of org/sft and of org/later (HUB_RETRY_S each), none for the others


def test_a_pinned_hub_model_loads_that_revision_from_the_hub_cache_offline(hub, assets, tmp_path):
    """A cluster without the hub but with its cache filled: `org/name#<sha>` is that snapshot; a revision the cache
    does not hold fails retryably (exit 1), naming the model."""
    snapshot = tmp_path / "hf-home" / "hub" / "models--org--policy" / "snapshots" / HUB_REVISION
    shutil.copytree(assets["model"], snapshot)
    hub.close()
    offline = {"HF_HUB_OFFLINE": "1"}
    done = run_on_hub(hub, tmp_path, "load model", f"org/policy#{HUB_REVISION}", offline)
    assert done.returncode == 0 and done.stdout.strip().endswith(str(snapshot)), done.stdout + done.stderr
    other = "f" * 40
    done = run_on_hub(hub, tmp_path, "load model", f"org/policy#{other}", offline)
    assert done.returncode == 1 and f"SourceUnavailable: hub model org/policy#{other}" in done.stdout, done.stdout


@pytest.mark.parametrize(("status", "expected"), [(None, 1), (404, 2)], ids=["hub down", "no such dataset"])
def test_reading_a_hub_dataset_fails_retryably_when_the_hub_is_down_and_at_once_when_there_is_no_such_dataset(
        hub, tmp_path, status, expected):  # fmt: skip
    if status is None:
        hub.close()  # connections refused (5xx answers huggingface_hub retries itself, for half a minute)
    else:
        hub.fail(status)
    done = run_on_hub(hub, tmp_path, "read", f"org/prompts#{HUB_REVISION}")
    assert done.returncode == expected, done.stdout + done.stderr
