"""Nightly retraining without a cluster: the shape table, the gate's rules, data fingerprints in stage keys (local
and S3), the rehearsal's derived swaps, `python -m flows.run --plan` on the GPU presets, and the math reward of the
GRPO preset. The runs themselves are in test_pipeline.py (real stages) and test_orchestration.py (toy stages)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import s3fs
import yaml

from flows.run import metrics_table
from pipeline.config import (
    PIPELINE_SHAPES,
    POLICY_STAGES,
    STAGE_INPUTS,
    TINY_ASSET_FIELDS,
    PromotionGate,
    load_pipeline_config,
    overrides_out_of_bounds,
    policy_stage,
    refused_overrides,
    shape_inputs,
)
from infra.settings import get_settings
from pipeline.gate import check_gate
from pipeline.identity import stage_identity
from pipeline.memory import CONTEXT_BYTES, GIB, ModelShape, frozen_memory, rl_memory, trained_memory
from pipeline.plan import ClusterResources, _check_fit, check_gate_sample, ray_request
from pipeline.rehearsal import build_stand_ins, rehearse_pipeline, swap_table
from stages.cli import parse_stage_args
from stages.config import ConfigError
from stages.registry import STAGES

ROOT = Path(__file__).resolve().parent.parent
GPU_PRESETS = ("llama3-8b", "llama3-8b-grpo")


# ---------------------------------------------------------------------------------------------- shapes

@pytest.mark.parametrize("shape", PIPELINE_SHAPES)
def test_every_shape_ends_in_an_evaluation_of_its_one_policy_fed_by_earlier_stages(shape):
    stages = PIPELINE_SHAPES[shape]
    assert stages[-1] == "evaluate" and policy_stage(shape) in POLICY_STAGES
    wiring = shape_inputs(shape)
    assert wiring["evaluate"]["pretrain"] == policy_stage(shape)
    for stage, fed in wiring.items():
        for field, producer in fed.items():
            assert stages.index(producer) < stages.index(stage), (stage, field)
            assert field in STAGES[stage].model_fields, (stage, field)
    assert shape.replace("rm", "reward_model").split("-") == [s for s in stages if s != "evaluate"]


def test_the_tables_name_existing_fields():
    for stage, field in [*STAGE_INPUTS, *TINY_ASSET_FIELDS]:
        assert field in STAGES[stage].model_fields, (stage, field)


@pytest.mark.parametrize("overrides, message", [
    ({"shape": "dpo", "evaluate": {"ref_pretrain": None}}, r"evaluate\.ref_pretrain unset: no stage of shape 'dpo' provides it, and no tiny_assets_dir"),
    ({"shape": "rl", "rl": {"pretrain": None}}, r"rl\.pretrain unset: no stage of shape 'rl'"),
    ({"shape": "pipeline"}, r"invalid value for shape: Input should be 'sft-rm-rl'"),
    ({"gate": {"max_accuracy_regression": -0.1}}, r"invalid value for gate\.max_accuracy_regression"),
    ({"rl": {"advantage_estimator": "ppo"}}, r"invalid value for rl\.advantage_estimator"),
])  # fmt: skip
def test_a_preset_that_cannot_run_its_shape_is_refused_naming_stage_and_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_pipeline_config("llama3-8b", overrides)


def test_shapes_without_sft_take_their_start_from_the_section():
    grpo = load_pipeline_config("llama3-8b-grpo")
    assert grpo.stages == ("rl", "evaluate") and grpo.rl.pretrain == grpo.evaluate.ref_pretrain
    assert load_pipeline_config("llama3-8b", {"shape": "rm-rl"}).stages == ("reward_model", "rl", "evaluate")


def test_an_rl_agent_gives_the_evaluation_its_episodes_and_no_reward_function_is_filled_in(assets):
    from pipeline.prepare import prepare

    built = str(Path(assets["prompts_train"]).parent.parent)  # the session's tiny assets, reused as they are
    config = load_pipeline_config("tiny", {"shape": "sft-rl", "tiny_assets_dir": built,
                                           "rl": {"agent_func_path": "stages/tiny_agent.py"}})
    prepared = prepare(config, log=lambda line: None)
    agent = str(Path(__file__).resolve().parent.parent / "stages" / "tiny_agent.py")
    assert prepared.rl.agent_func_path == prepared.evaluate.agent_func_path == agent
    assert prepared.rl.remote_rm_url is None and prepared.evaluate.remote_rm_url is None
    plain = prepare(load_pipeline_config("tiny", {"shape": "sft-rl", "tiny_assets_dir": built}),
                    log=lambda line: None)
    assert plain.evaluate.agent_func_path is None and plain.rl.remote_rm_url.endswith("tiny_reward.py")


# ---------------------------------------------------------------------------------------------- the gate

def test_every_gate_threshold_is_a_pipeline_field_and_acts():
    # The approval fields act in the flow (tests/test_deployment.py: approved in the browser, rejected by timeout).
    assert set(PromotionGate.model_fields) == {"min_reward_gain", "min_accuracy_gain", "min_prompts", "max_kl_mean",
                                               "max_reward_regression", "max_accuracy_regression",
                                               "require_approval", "approval_timeout_s", "decide_on_intervals", "rules",
                                               "max_logprob_gap", "max_tries_against_production"}
    assert load_pipeline_config("tiny").gate.max_accuracy_regression == 0.02
    report = {"accuracy": 0.50, "reference_accuracy": 0.30, "reward_mean": 1.0, "reference_reward_mean": 0.5,
              "kl_mean": 0.4, "production_accuracy": 0.51, "production_reward_mean": 1.02, "prompts": 200}
    assert check_gate(report, PromotionGate(), production_version=3)[0]  # within both tolerances
    for field, value, failing in [("min_accuracy_gain", 0.3, "FAIL accuracy gain"),
                                  ("min_reward_gain", 0.5, "FAIL reward gain"),
                                  ("max_kl_mean", 0.3, "FAIL kl_mean"),
                                  ("max_accuracy_regression", 0.005, "FAIL accuracy 0.5000 vs production v3"),
                                  ("max_reward_regression", 0.01, "FAIL reward_mean 1.0000 vs production v3"),
                                  ("min_prompts", 201, "FAIL judged on 200 held-out prompts (needs >= 201)")]:
        passed, reasons = check_gate(report, PromotionGate(**{field: value}), production_version=3)
        assert not passed and [r for r in reasons if r.startswith("FAIL")][0].startswith(failing), (field, reasons)
    # The engines' log-prob gap: the evaluation's is required, the RL candidate's last sync's judged where it has one.
    gapped = {**report, "logprob_gap_mean": 0.03}
    assert check_gate(gapped, PromotionGate(max_logprob_gap=0.05), 3, {"weight_sync_probe_gap_mean": 0.01})[0]
    for metrics, candidate, failing in [
            (report, {}, "FAIL report has no logprob_gap_mean"),
            ({**report, "logprob_gap_mean": 0.08}, {}, "FAIL log-prob gap of the evaluation's engines 0.0800"),
            (gapped, {"weight_sync_probe_gap_mean": 0.2}, "FAIL log-prob gap at the candidate's last weight sync")]:
        passed, reasons = check_gate(metrics, PromotionGate(max_logprob_gap=0.05), 3, candidate)
        assert not passed and reasons[0].startswith(failing), reasons
    # Candidates judged against one production policy: each is another draw of the same held-out metrics.
    bounded = PromotionGate(max_tries_against_production=3)
    assert check_gate(report, bounded, 3, tries_against_production=3)[0]
    assert check_gate(report, bounded, None, tries_against_production=None)[0]  # nothing to be judged against
    passed, reasons = check_gate(report, bounded, 3, tries_against_production=4)
    assert not passed and reasons[0].startswith("FAIL candidate 4 judged against production v3 (allows at most 3")
    # Production exists but the report did not score it: no decision without it.
    no_production = {k: v for k, v in report.items() if not k.startswith("production_")}
    passed, reasons = check_gate(no_production, PromotionGate(), production_version=3)
    assert not passed and "no production_ metrics although production v3 exists" in reasons[0]
    assert check_gate(no_production, PromotionGate(), production_version=None)[0]


def test_a_gate_on_intervals_refuses_a_gain_or_a_regression_within_noise():
    """decide_on_intervals: a gain counts with its interval's low end, a regression against production with its
    high end; the same differences pass on the point estimates."""
    report = {"accuracy": 0.55, "reference_accuracy": 0.50, "kl_mean": 0.1, "prompts": 500,
              "production_accuracy": 0.56,
              "accuracy_gain_vs_reference": 0.05, "accuracy_gain_vs_reference_low": -0.01,
              "accuracy_gain_vs_reference_high": 0.11,
              "accuracy_gain_vs_production": -0.01, "accuracy_gain_vs_production_low": -0.04,
              "accuracy_gain_vs_production_high": 0.02}
    gate = {"min_accuracy_gain": 0.0, "max_accuracy_regression": 0.02}
    assert check_gate(report, PromotionGate(**gate), production_version=3)[0]  # on the differences: passes
    passed, reasons = check_gate(report, PromotionGate(**gate, decide_on_intervals=True), production_version=3)
    assert not passed
    assert reasons[:2] == [
        "FAIL accuracy gain over the reference +0.0500, 95% interval [-0.0100, +0.1100] (needs >= +0.0000)",
        "FAIL accuracy 0.5500 vs production v3 0.5600: regression +0.0100 (gain -0.0100, 95% interval [-0.0400, "
        "+0.0200]; tolerance 0.02)"]
    # A clear gain over both passes; a report without intervals cannot pass a gate that asks for them.
    clear = {**report, "accuracy_gain_vs_reference_low": 0.02, "accuracy_gain_vs_production_low": -0.015}
    assert check_gate(clear, PromotionGate(**gate, decide_on_intervals=True), production_version=3)[0]
    bare = {k: v for k, v in report.items() if "_vs_" not in k}
    passed, reasons = check_gate(bare, PromotionGate(**gate, decide_on_intervals=True), production_version=None)
    assert not passed and "without the interval decide_on_intervals needs" in reasons[0]


def test_a_deployment_is_run_only_as_the_installed_prefect_yaml_defines_it(tmp_path):
    """The server's copy of a deployment is compared with prefect.yaml on the worker: a changed parameter or job
    variable, a deployment the file lacks, and a run's own job variables are refused, naming keys, never values."""
    from flows.full_rlhf import DeploymentChanged, OverrideRefused, check_deployment

    installed = yaml.safe_load((Path(__file__).resolve().parent.parent / "prefect.yaml").read_text())
    (tiny,) = [d for d in installed["deployments"] if d["name"] == "tiny"]
    settings = get_settings()
    as_deployed = SimpleNamespace(name="tiny", parameters=tiny["parameters"], job_variables={})
    check_deployment(as_deployed, {}, settings)
    loosened = {"config": {**tiny["parameters"]["config"], "gate": {**tiny["parameters"]["config"]["gate"],
                                                                    "min_prompts": 1}}}
    with pytest.raises(DeploymentChanged, match=r"at parameters.config.gate.min_prompts: not running it") as error:
        check_deployment(SimpleNamespace(**{**vars(as_deployed), "parameters": loosened}), {}, settings)
    assert "min_prompts: 1" not in str(error.value)
    with pytest.raises(DeploymentChanged, match=r"at job_variables.env: not running it"):
        check_deployment(SimpleNamespace(**{**vars(as_deployed), "job_variables": {"env": {"A": "b"}}}), {}, settings)
    with pytest.raises(DeploymentChanged, match=r"deployment nightly-2 is not one of .*prefect.yaml"):
        check_deployment(SimpleNamespace(**{**vars(as_deployed), "name": "nightly-2"}), {}, settings)
    with pytest.raises(OverrideRefused, match=r"sets job variables command, labels: what a run executes"):
        check_deployment(as_deployed, {"labels": {"a": "b"}, "command": "sh"}, settings)
    with pytest.raises(DeploymentChanged, match=r"cannot read the installed deployments .*absent.yaml"):
        check_deployment(as_deployed, {}, get_settings(deployments_file=tmp_path / "absent.yaml"))


def test_what_the_gate_judges_on_is_the_deployments_alone(tmp_path):
    """A run may not pick the evaluation's seed, prompt count or engine, nor turn checkpoints off or make them
    rarer; a preset whose evaluation is smaller than the gate's minimum is a problem of the plan."""
    deployed = load_pipeline_config("llama3-8b")
    for section, field, value in [("evaluate", "max_samples", 3), ("evaluate", "seed", 7), ("gate", "min_prompts", 1)]:
        run = load_pipeline_config("llama3-8b", {section: {field: value}})
        assert refused_overrides(deployed, run) == [f"{section}.{field}"]
    quick = load_pipeline_config("llama3-8b", {"rl": {"max_samples": 64, "save_steps": 2}, "sft": {"seed": 3}})
    assert refused_overrides(deployed, quick) == [] and overrides_out_of_bounds(deployed, quick) == []
    off = load_pipeline_config("llama3-8b", {"rl": {"save_steps": -1}, "dpo": {"save_steps": -1}})
    assert refused_overrides(deployed, off) == []
    assert overrides_out_of_bounds(deployed, off) == ["dpo.save_steps=-1 (at least 1)", "rl.save_steps=-1 (at least 1)"]
    rare = load_pipeline_config("llama3-8b", {"rl": {"save_steps": 100000}, "sft": {"save_steps": 100}})
    assert overrides_out_of_bounds(deployed, rare) == [
        f"rl.save_steps=100000 (at most {deployed.rl.save_steps}, the deployment's)"]  # sft's 100 is more often
    # Which engine samples the evaluation's answers is the deployment's: another is another draw the gate judges.
    other_engine = load_pipeline_config("llama3-8b", {"evaluate": {"rollout_backend": "vllm"},
                                                      "rl": {"rollout_backend": "vllm"}})
    assert refused_overrides(deployed, other_engine) == ["evaluate.rollout_backend"]
    notes, problems = [], []
    check_gate_sample(load_pipeline_config("llama3-8b", {"evaluate": {"max_samples": 200}}), notes, problems)
    assert problems == ["evaluate.max_samples=200 is below gate.min_prompts=500: no candidate could ever be promoted"]
    assert "judges the candidate on at most evaluate.max_samples=200 held-out prompts" in notes[0]


# ---------------------------------------------------------------------------------------------- fingerprints

def test_the_stage_key_follows_data_content_not_paths(tmp_path):
    data = tmp_path / "prefs.jsonl"
    data.write_text('{"prompt": "1+1", "chosen": "2", "rejected": "3"}\n')
    config = {"dataset": str(data), "learning_rate": 1e-5, "pretrain": None}

    def identity():
        return stage_identity("p", "reward_model", config, {}, code="c")

    first = identity()
    assert identity().key == first.key and first.datasets["dataset"].fingerprint.startswith("sha256:")
    data.write_text('{"prompt": "1+1", "chosen": "2", "rejected": "4"}\n')  # one row changed, same path
    assert identity().key != first.key and identity().datasets["dataset"].source == str(data)
    reward = tmp_path / "reward.py"  # a local reward function is fingerprinted like data
    reward.write_text("def reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    rl_config = {"prompt_data": str(data), "actor_learning_rate": 1e-6}
    with_reward = stage_identity("p", "rl", {**rl_config, "remote_rm_url": str(reward)}, {}, code="c")
    reward.write_text("def reward_func(q, p, l):\n    return [1.0] * len(q)\n")
    assert stage_identity("p", "rl", {**rl_config, "remote_rm_url": str(reward)}, {}, code="c").key != with_reward.key
    endpoint = stage_identity("p", "rl", {**rl_config, "remote_rm_url": "http://rm:5000/get_reward"}, {}, code="c")
    assert set(endpoint.datasets) == {"prompt_data"}  # an HTTP endpoint is not data


def test_s3_datasets_are_fingerprinted_by_etag_without_download(s3_root):
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    uri = f"{s3_root}/data/prompts.jsonl"
    fs.pipe_file(uri, b'{"prompt": "1+1", "label": "2"}\n')
    config = {"prompt_data": uri}
    first = stage_identity("p", "rl", config, {}, code="c")
    assert first.datasets["prompt_data"].fingerprint.startswith("s3:")
    assert stage_identity("p", "rl", config, {}, code="c").key == first.key
    fs.pipe_file(uri, b'{"prompt": "1+1", "label": "3"}\n')
    assert stage_identity("p", "rl", config, {}, code="c").key != first.key


# ---------------------------------------------------------------------------------------------- rehearsal

@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    return build_stand_ins(tmp_path_factory.mktemp("stand-ins"))


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_a_rehearsal_keeps_every_setting_but_the_stated_swaps(preset, stand_ins, tmp_path):
    config = load_pipeline_config(preset)
    rehearsal, swaps = rehearse_pipeline(config, stand_ins, str(tmp_path / "artifacts"))
    swapped = {(swap.stage, swap.field) for swap in swaps}
    before, after = config.model_dump(mode="json"), rehearsal.model_dump(mode="json")
    for stage in config.stages:
        for field, value in before[stage].items():
            assert after[stage][field] == value or (stage, field) in swapped, (stage, field)
        assert after[stage]["device"] == "cpu"
    assert (after["shape"], after["name"]) == (before["shape"], before["name"])
    # The gate's rules stay; the number of prompts it needs is the rehearsal's evaluation's, stated as a swap.
    gate_swaps = {field for stage, field in swapped if stage == "gate"}
    assert gate_swaps <= {"min_prompts"} and after["gate"]["min_prompts"] <= after["evaluate"]["max_samples"]
    assert {k: v for k, v in after["gate"].items() if k not in gate_swaps} == \
        {k: v for k, v in before["gate"].items() if k not in gate_swaps}
    for stage in {"sft", "reward_model", "dpo", "kto"} - set(config.stages):
        assert after[stage] == before[stage]  # sections the shape does not run are left alone
    # Nothing a GPU cluster also has is swapped: the settings that make the preset what it is stay.
    kept = {"zero_stage", "bf16", "gradient_checkpointing", "packing_samples", "colocate_all_models",
            "vllm_enable_sleep", "deepspeed_enable_sleep", "flash_attn", "vllm_sync_backend", "advantage_estimator", "use_kl_loss", "kl_estimator",
            "init_kl_coef", "normalize_reward", "learning_rate", "actor_learning_rate", "apply_chat_template",
            "input_key", "label_key", "remote_rm_url", "n_samples_per_prompt"}
    assert not {field for _, field in swapped} & kept
    table = swap_table(swaps).splitlines()
    assert table[0].split() == ["stage", "field", "preset", "rehearsal", "why"] and len(table) == len(swaps) + 1


def test_rehearsal_fixtures_keep_the_presets_formats(stand_ins, tmp_path):
    import json

    rehearsal, _ = rehearse_pipeline(load_pipeline_config("llama3-8b"), stand_ins, str(tmp_path / "artifacts"))
    first = {stage: json.loads(Path(getattr(rehearsal, stage).dataset if stage != "rl" else rehearsal.rl.prompt_data)
                               .read_text().splitlines()[0]) for stage in ("sft", "reward_model", "rl")}
    assert set(first["sft"]) == {"question", "response"}  # OpenOrca's columns, as the preset names them
    assert [m["role"] for m in first["reward_model"]["chosen"]] == ["user", "assistant"]  # conversations, no prompt
    assert first["rl"]["context_messages"][0]["role"] == "user"  # chat messages under the preset's input_key


# ---------------------------------------------------------------------------------------------- the plan

def run_plan(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "flows.run", "--plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    return done, time.monotonic() - started


# Meta-Llama-3-8B's config.json (the presets' models all have this shape), as the hub serves it.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192}
PRESET_MODELS = ("meta-llama/Meta-Llama-3-8B", "OpenRLHF/Llama-3-8b-sft-mixture", "OpenRLHF/Llama-3-8b-rm-700k")


def offline_hub_with_configs(home: Path) -> dict[str, str]:
    """An HF cache at `home` holding the presets' models' config.json (what a plan downloads, seconds), and the
    environment that reads it offline, as this machine is."""
    import json

    for name in PRESET_MODELS:
        folder = home / "hub" / f"models--{name.replace('/', '--')}"
        snapshot = folder / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(LLAMA3_8B))
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text("0" * 40)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(home)}


def test_the_parameter_count_comes_from_the_config():
    assert ModelShape.from_config(LLAMA3_8B).params == 8_030_261_248  # Meta-Llama-3-8B's published count
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "tie_word_embeddings": True}
    # GPT-2's 124.4M within 1% (its position embeddings and biases are left out).
    assert ModelShape.from_config(gpt2).params == pytest.approx(124_439_808, rel=0.01)


def test_memory_of_a_trained_and_a_frozen_model_worked_numbers():
    """N = 1e9 in bf16 over 8 ranks: ZeRO-3 partitions weights (2e9 / 8), gradients (2e9 / 8) and Adam (12e9 / 8);
    ZeRO-2 keeps the weights whole; --adam_offload keeps Adam on the host. Activations of 2 × 50 tokens, h = 1000,
    L = 10, V = 100, checkpointed: 10 × 100 × 1000 × 2 and one layer (12h + 2h + 3 × 4h) × 100 × 2 = 5.2e6 (a
    two-matrix MLP of 4h, no grouped heads; larger than the logits, tests/test_memory.py has those)."""
    shape = ModelShape(params=10**9, hidden=1000, layers=10, vocab=100)
    common = dict(ranks=8, bf16=True, lora=False, tokens=2 * 50, with_logits=True)
    zero3 = trained_memory("actor", shape, zero_stage=3, adam_offload=False, gradient_checkpointing=True, **common)
    assert (zero3.weights, zero3.gradients, zero3.optimizer) == (2.5e8, 2.5e8, 1.5e9)
    assert (zero3.checkpoints, zero3.layer) == (2e6, 5.2e6)
    zero2 = trained_memory("actor", shape, zero_stage=2, adam_offload=True, gradient_checkpointing=False, **common)
    assert (zero2.weights, zero2.gradients, zero2.optimizer) == (2e9, 2.5e8, 0.0)
    assert zero2.activations == 10 * 26 * 100 * 1000 * 2 + zero2.logits  # every layer kept whole, then the logits
    frozen = frozen_memory("ref", shape, ranks=8, zero_stage=3, bf16=True, tokens=2 * 50, with_logits=True)
    assert (frozen.weights, frozen.gradients, frozen.optimizer) == (2.5e8, 0.0, 0.0)
    # --ref_reward_offload: the partitions in host memory, one layer (1e9 / 10 parameters) gathered at a time.
    offloaded = frozen_memory("ref", shape, ranks=8, zero_stage=3, bf16=True, tokens=2 * 50, with_logits=True,
                              offloaded=True)
    assert offloaded.weights == 2e8 and offloaded.activations == frozen.activations - frozen.gathered
    # fp32: 4-byte activations.
    fp32 = trained_memory("actor", shape, zero_stage=3, adam_offload=False, gradient_checkpointing=True,
                          **{**common, "bf16": False})
    assert (fp32.checkpoints, fp32.layer) == (4e6, 10.4e6)


def test_4bit_weights_worked_numbers():
    """--load_in_4bit: NF4 with double quantization is 4 + (8 + 32 / 256) / 64 = 4.127 bits a weight; Llama-3-8B's
    6.98e9 linear and norm parameters then take 3.60e9 bytes, its 1.05e9 embedding and head parameters stay bf16
    (2.10e9 bytes): 5.70e9 bytes instead of 16.06e9. With LoRA only the adapters have gradients and Adam states."""
    shape = ModelShape.from_config(LLAMA3_8B)
    assert shape.embeddings == 2 * 128_256 * 4096
    assert shape.weight_bytes(bf16=True, load_in_4bit=True) == pytest.approx(
        (8_030_261_248 - 1_050_673_152) * 4.127 / 8 + 1_050_673_152 * 2, rel=1e-4)
    assert shape.weight_bytes(bf16=True, load_in_4bit=True) == pytest.approx(5.70e9, rel=1e-3)
    qlora = trained_memory("actor", shape, ranks=8, zero_stage=2, bf16=True, adam_offload=False, lora=True,
                           gradient_checkpointing=True, tokens=100, with_logits=True, load_in_4bit=True)
    assert (qlora.weights, qlora.gradients, qlora.optimizer) == (shape.weight_bytes(True, True), 0.0, 0.0)


def test_colocated_models_peak_at_their_largest_phase_and_sleep_frees_the_rest():
    """llama3-8b's RL (everything on the 8 GPUs, ZeRO-3, both sleep modes): the peak is generation, the engines awake
    beside every model's bf16 weights (the engines sleep while the models load, the trained models' states sleep
    while the engines generate); without the sleep modes every model's states stay resident."""
    cfg = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b"], require_inputs=False)
    shape = ModelShape.from_config(LLAMA3_8B)
    shapes = {role: shape for role in ("actor", "critic", "ref", "reward")}
    [group] = rl_memory(cfg, shapes, 80 * GIB)
    role = {m.role: m for m in group.members}
    assert group.where == "shared by every model" and group.peak_phase == "generation"
    assert group.peak == pytest.approx(40 * GIB + role["actor"].weights + role["critic"].weights + role["ref"].weights
                                       + role["reward"].weights + 2 * CONTEXT_BYTES)
    awake = cfg.model_copy(update={"vllm_enable_sleep": False, "deepspeed_enable_sleep": False})
    [awake_group] = rl_memory(awake, shapes, 80 * GIB)
    role = {m.role: m for m in awake_group.members}
    # Awake, the actor's training turn has every model's states and the engines beside its working memory.
    assert awake_group.peak_phase == "actor training"
    assert awake_group.peak == pytest.approx(role["actor"].working + role["critic"].states + role["ref"].states
                                             + role["reward"].states + 40 * GIB + 2 * CONTEXT_BYTES)
    # --use_dynamic_batch: micro-batches of at most 8192 tokens instead of 16 full-length (2048-token) sequences.
    dynamic = awake.model_copy(update={"use_dynamic_batch": True, "train_max_tokens_per_gpu": 8192})
    [dynamic_group] = rl_memory(dynamic, shapes, 80 * GIB)
    ref = {m.role: m for m in dynamic_group.members}["ref"]
    assert ref.layer == pytest.approx(role["ref"].layer * 8192 / (16 * 2048))
    # --ring_attn_size 4: each rank of a ring runs a quarter of a micro-batch's tokens.
    ring = awake.model_copy(update={"ring_attn_size": 4, "packing_samples": True})
    [ring_group] = rl_memory(ring, shapes, 80 * GIB)
    ring_role = {m.role: m for m in ring_group.members}
    assert ring_role["actor"].checkpoints == pytest.approx(role["actor"].checkpoints / 4)
    assert ring_role["actor"].states == role["actor"].states
    apart = cfg.model_copy(update={"colocate_all_models": False, "vllm_enable_sleep": False,
                                   "deepspeed_enable_sleep": False})
    assert [g.where for g in rl_memory(apart, shapes, 80 * GIB)] == ["actor", "ref", "critic", "reward",
                                                                      "engines"]  # each on GPUs of its own


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_plan_of_a_gpu_preset_in_seconds(preset, tmp_path):
    # Offline, as this machine is (the hub's revision look-ups and their retries: tests/test_transient.py).
    done, seconds = run_plan("--preset", preset, "--artifact_root", str(tmp_path / "artifacts"),
                             env=offline_hub_with_configs(tmp_path / "hf"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"--plan {preset}: {seconds:.1f} s\n{done.stdout}")
    out = done.stdout
    config = load_pipeline_config(preset)
    assert out.startswith(f"pipeline {preset!r}, shape {config.shape}: " + " -> ".join(config.stages))
    for stage in config.stages:
        section = out.split(f"[{stage}] inputs:", 1)[1]
        assert f"python -m stages.{stage} --device cuda" in section
        assert "bundle(s) of 1 GPU + 1 CPU on cuda" in section
        assert any(f"would run ({why}" in section for why in ("no committed artifact", "an earlier stage runs",
                                                              "no stage key: a hub revision is unknown here"))
    assert "schema not checked: the hub cannot be reached" in out  # hub datasets, offline here
    assert "not pinned here, the flow's plan pins it" in out
    assert "plan OK" in out and seconds < 60
    # The per-GPU memory table of the RL stage, every role estimated from its model's config.json.
    table = out.split("memory per GPU (GiB, of 80", 1)[1].split("python -m stages.rl", 1)[0]
    roles = (("actor", "critic", "ref", "reward", "actor.fwd", "critic.fwd", "engines") if preset == "llama3-8b"
             else ("actor", "ref", "actor.fwd", "engines"))
    assert [line.split()[0] for line in table.splitlines()[2:2 + len(roles)]] == list(roles), table
    # generation: the engines awake (40 at 0.5) beside the models' bf16 weights
    peak = {"llama3-8b": "49.5", "llama3-8b-grpo": "45.7"}[preset]
    assert f"peak on the GPUs shared by every model: {peak} (generation)" in table, table
    assert "phase start-up" in table and "phase generation" in table
    assert "no memory estimate" not in out


def test_reward_files_come_only_from_the_projects_own_folders_or_reward_dirs_never_where_jobs_write(tmp_path):
    """The project's configs/ and stages/ and RLHF_REWARD_DIRS; not the rest of the checkout (the default workspace
    and artifact root are in it), not site-packages, not a workspace or artifact root even inside a listed folder."""
    from pipeline.plan import check_reward_sources

    shared = tmp_path / "shared"
    (shared / "workspace").mkdir(parents=True)
    for path in (shared / "mine.py", shared / "workspace" / "planted.py", shared / "artifacts" / "planted.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("def reward_func(queries, prompts, labels):\n    return [1.0] * len(queries)\n")
    settings = get_settings(reward_dirs=str(shared), workspace_root=shared / "workspace")
    checkout_cache = Path(__file__).resolve().parent.parent / ".cache" / "reward.py"
    cases = {"configs/reward_funcs/math_answer.py": True, str(shared / "mine.py"): True,
             str(shared / "workspace" / "planted.py"): False, str(shared / "artifacts" / "planted.py"): False,
             str(checkout_cache): False, yaml.__file__: False}
    for spec, allowed in cases.items():
        config = load_pipeline_config("llama3-8b-grpo", {"rl": {"remote_rm_url": spec},
                                                         "evaluate": {"remote_rm_url": spec}})
        problems: list[str] = []
        check_reward_sources(config, settings, problems, artifact_root=str(shared / "artifacts"))
        assert (problems == []) == allowed, (spec, problems)
        assert allowed or problems[0].startswith(f"rl.remote_rm_url: {spec} is outside the project's configs/")
    # lm-eval task files are code too (`!function`): the same folders, and every file of them in the stage key.
    tasks = shared / "workspace" / "lm-eval-tasks"
    tasks.mkdir()
    (tasks / "task.yaml").write_text("task: mine\n")
    config = load_pipeline_config("llama3-8b-grpo", {"evaluate": {"lm_eval": ["mine"],
                                                                  "lm_eval_include_path": str(tasks)}})
    problems = []
    check_reward_sources(config, settings, problems, artifact_root=str(shared / "artifacts"))
    assert problems and problems[0].startswith(f"evaluate.lm_eval_include_path: {tasks} is outside")
    (shared / "prompts.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    section = {"pretrain": "m", "prompt_data": str(shared / "prompts.jsonl"), "lm_eval": ["mine"],
               "lm_eval_include_path": str(tasks), "remote_rm_url": "configs/reward_funcs/math_answer.py"}
    before = stage_identity("p", "evaluate", section, {}, "code")
    (tasks / "utils.py").write_text("def process(doc):\n    return doc\n")
    after = stage_identity("p", "evaluate", section, {}, "code")
    assert before.key != after.key and after.datasets["lm_eval_include_path"].fingerprint.startswith("code-dir:")


def test_a_damaged_production_policy_is_quarantined_and_named_in_the_plan(tmp_path):
    """A production version damaged in the store (same size, other bytes) would be refused by the evaluation every
    night: the plan finds it, quarantines it and says that the candidate is judged on its reference alone."""
    from infra.artifacts import open_store
    from tests.conftest import replace_stored

    root = tmp_path / "artifacts"
    store = open_store(str(root), "llama3-8b")
    policy = tmp_path / "policy"
    policy.mkdir()
    (policy / "model.safetensors").write_bytes(b"weights " * 64)
    store.commit("rl", policy, config={})
    store.set_alias("rl", "production", 1)
    replace_stored(store.fs, f"{store.fs._strip_protocol(store.get('rl', 1).uri)}/model.safetensors", b"w" * 512)
    done, _ = run_plan("--preset", "llama3-8b", "--artifact_root", str(root),
                       env=offline_hub_with_configs(tmp_path / "hf"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "production: rl v1 is quarantined (production policy found damaged: " in done.stdout, done.stdout
    assert "the gate judges the candidate on its reference alone" in done.stdout
    assert "model.safetensors: sha256 " in store.quarantined("rl")[1]


def test_a_plan_that_does_not_fit_its_gpus_is_refused_naming_the_numbers(tmp_path):
    env = {**offline_hub_with_configs(tmp_path / "hf"), "RLHF_GPU_MEMORY_GIB": "24"}
    done, _ = run_plan("--preset", "llama3-8b", "--artifact_root", str(tmp_path / "artifacts"), env=env)
    assert done.returncode == 1, done.stdout[-3000:]
    problem = next(line for line in done.stdout.splitlines() if line.startswith("PROBLEM: rl: the GPUs"))
    # 24 GiB GPUs: the engines' share scales (12 of them), the actor's training turn does not.
    assert ("shared by every model need about 39.4 GiB each in the actor training phase (also over 24 GiB: start-up "
            "38.5, critic training 34.7)") in problem, problem
    assert "more than the 24 GiB of a GPU (RLHF_GPU_MEMORY_GIB)" in problem


def test_plan_fails_naming_the_stage_and_field(tmp_path):
    broken = yaml.safe_load((ROOT / "configs" / "llama3-8b.yaml").read_text())
    broken["rl"]["vllm_enable_sleep"] = True
    broken["rl"]["colocate_all_models"] = False
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    done, _ = run_plan("--preset", str(path))
    assert done.returncode == 2 and "rl: --vllm_enable_sleep requires --colocate_all_models" in done.stderr

    tiny = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    tiny["sft"]["input_key"] = "question"  # the tiny SFT data has no such column
    tiny["tiny_assets_dir"] = str(tmp_path / "tiny-assets")
    path.write_text(yaml.safe_dump(tiny))
    done, _ = run_plan("--preset", str(path), "--artifact_root", str(tmp_path / "artifacts"))
    assert done.returncode == 1, done.stdout[-2000:]
    problem = next(line for line in done.stdout.splitlines() if line.startswith("PROBLEM:"))
    assert problem.startswith("PROBLEM: sft.dataset: SFT data in ") and "sft_train.jsonl" in problem
    assert "column 'question' (--input_key): column is missing" in done.stdout


def test_the_plan_checks_each_stage_data_with_the_stage_own_validation(tmp_path):
    """KTO rows (unpaired, with a label) and multi-turn SFT conversations are checked as their stages check them."""
    import json

    from pipeline.plan import check_datasets

    kto_rows = tmp_path / "kto.jsonl"
    kto_rows.write_text("\n".join(json.dumps({"prompt": "2+3=", "completion": "5", "label": True}) for _ in range(3)))
    kto = STAGES["kto"](pretrain="m", dataset=str(kto_rows), input_key="prompt", output_key="completion",
                               label_key="label")
    problems = []
    assert [c.schema_check for c in check_datasets("kto", kto, problems)] == ["ok (3 rows)"] and problems == []
    unlabelled = kto.model_copy(update={"label_key": "desirable"})
    check_datasets("kto", unlabelled, problems)
    assert problems and problems[0].startswith("kto.dataset: ") and "'desirable'" in problems[0]

    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))  # no assistant turn to learn
    sft = STAGES["sft"](pretrain="m", dataset=str(chat), input_key="messages", multiturn=True,
                               apply_chat_template=True)
    check_datasets("sft", sft, problems := [])
    assert problems and problems[0].startswith("sft.dataset: ")


def test_resources_beyond_the_cluster_are_a_problem_there_and_a_note_here():
    rl = load_pipeline_config("llama3-8b").rl
    bundles, bundle = ray_request("rl", rl, "cuda", cores=16)
    assert (bundles, bundle) == (8, {"GPU": 1.0, "CPU": 1.0})  # everything colocated on the actor's 8 GPUs
    cluster = ClusterResources(where="a 4-GPU cluster", cpus=64, gpus=4, binding=True)
    problems, notes = [], []
    _check_fit("rl", "cuda", bundles, bundle, cluster, problems, notes)
    assert problems == ["rl.*_num_nodes × *_num_gpus_per_node, vllm_num_engines × vllm_tensor_parallel_size: rl "
                        "asks 8 bundle(s), 8 GPU (has 4), of a 4-GPU cluster"] and notes == []
    laptop = cluster.model_copy(update={"where": "this machine", "gpus": 0, "binding": False})
    _check_fit("rl", "cuda", bundles, bundle, laptop, problems := [], notes)
    assert problems == [] and notes[0].startswith("rl.device cuda: rl asks 8 bundle(s), 8 GPU (has 0)")


# ---------------------------------------------------------------------------------------------- rewards

def test_the_math_reward_checks_final_answers():
    spec = importlib.util.spec_from_file_location("math_answer", ROOT / "configs" / "reward_funcs" / "math_answer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    queries = ["Q: x. A: so \\boxed{\\frac{1}{2}}.", "Q: y. A: Answer: 7", "Q: z. A: it is 1,234.", "Q: w. A: 8",
               "Q: v. A: Answer: 5", "Q: u. A: no idea"]
    prompts = ["Q: x. A:", "Q: y. A:", "Q: z. A:", "Q: w. A:", "Q: v. A:", "Q: u. A:"]
    labels = ["\\frac{1}{2}", "7", "1234", "so #### 8", "6", "3"]
    assert module.reward_func(queries, prompts, labels) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # Equal as mathematics, not as text: math-verify's sympy comparison.
    queries = ["Q: a. A: \\boxed{x^2+2x}", "Q: b. A: the answer is $0.5$", "Q: c. A: \\boxed{\\sqrt{4}}",
               "Q: d. A: \\boxed{x^2}"]
    labels = ["x(x+2)", "\\frac{1}{2}", "2", "x(x+2)"]
    assert module.reward_func(queries, [q.split("A:")[0] + "A:" for q in queries], labels) == [1.0, 1.0, 1.0, 0.0]
    # Where math-verify parses nothing, the text comparison stands in.
    assert module.is_correct("Answer: (b)", "(b)") and not module.is_correct("Answer: (c)", "(b)")


def test_the_run_summary_shows_each_stage_headline_metrics_within_the_terminal_width():
    evaluation = {"accuracy": 0.78, "accuracy_gain_vs_reference": 0.755, "accuracy_gain_vs_reference_low": 0.695,
                  "accuracy_gain_vs_reference_high": 0.815, "gsm8k/accuracy": 0.78, "math/pass4": 0.94, "kl_mean": 0.45,
                  "prompts": 200, "reference_accuracy": 0.025, "reward_mean": 2.567, "win_rate_vs_reference": 0.8775,
                  **{f"reference_{name}": 0.5 for name in ("maj4", "pass1", "pass4", "reward_mean", "response_length")}}
    training = {"eval_loss": 0.1731, "seconds/step": 12.08, "startup/imports": 2.59, "steps": 225}
    result = SimpleNamespace(stages={
        "sft": SimpleNamespace(metrics=training, reused=True, version=1, digest="91aac95585c1" * 4),
        "evaluate": SimpleNamespace(metrics=evaluation, reused=False, version=3, digest="374cf9f85fd1" * 4)})
    table = metrics_table(result, width=100).splitlines()
    assert all(len(line) <= 100 for line in table), table
    assert table[1].split()[:4] == ["sft", "v1", "reused", "91aac95585c1"] and table[1].endswith("steps=225")
    assert table[2].split()[:4] == ["evaluate", "v3", "ran", "374cf9f85fd1"] and len(table) > 3  # wrapped
    shown = " ".join(table)
    assert "eval_loss=0.1731" in shown and "kl_mean=0.45" in shown and "win_rate_vs_reference=0.8775" in shown
    assert not any(hidden in shown for hidden in ("/", "_low=", "_high=")), shown
