"""LoRA adapters: wrapping from the config fields, merged HF weights for outputs and rollout engines, export.

Stage runs with LoRA (ZeRO-3, rank actors, vLLM loading the merged output) are in tests/test_stages.py.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from stages import engine, lora, packing
from stages.cli import parse_stage_args
from stages.model_io import load_tokenizer
from stages.tiny import build_tiny_model

SEQUENCES = [[2, 40, 41, 42, 43, 3], [2, 50, 51, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def load(model_dir, value_model: bool):
    if value_model:
        return AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    return AutoModelForCausalLM.from_pretrained(model_dir)


def adapted(model_dir, value_model: bool, *flags: str):
    """The tiny model wrapped from --lora_* flags, adapters moved off their zero start (a trained adapter)."""
    cfg = parse_stage_args("sft", ["--config", "tiny", "--lora_rank", "4", "--lora_alpha", "8", *flags],
                           require_inputs=False)
    torch.manual_seed(0)
    model = lora.wrap(load(model_dir, value_model), cfg, value_model=value_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def outputs(model, value_model: bool) -> torch.Tensor:
    with torch.no_grad():
        if value_model:
            return packing.last_token_values(model, SEQUENCES, pad_token_id=0, packing=False)
        return torch.cat(packing.padded_log_probs(model, SEQUENCES, 0))


def test_wrap_trains_adapters_only_and_is_off_without_rank(model_dir):
    model = adapted(model_dir, False, "--target_modules", "q_proj", "v_proj")
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name and ("q_proj" in name or "v_proj" in name) for name in trained)
    value = adapted(model_dir, True)
    assert any("score.modules_to_save" in name for name, p in value.named_parameters() if p.requires_grad)
    plain = load(model_dir, False)
    assert lora.wrap(plain, parse_stage_args("sft", ["--config", "tiny"], require_inputs=False),
                     value_model=False) is plain


@pytest.mark.parametrize("value_model", [False, True])
def test_merged_named_weights_are_peft_merge_under_hf_names(model_dir, value_model):
    model = adapted(model_dir, value_model)
    merged = dict(lora.merged_named_weights(model))
    reference = adapted(model_dir, value_model).merge_and_unload()
    expected = reference.state_dict()
    assert merged.keys() == expected.keys()
    assert not any(part in name for name in merged for part in ("base_model", "base_layer", "lora_", "modules_to_save"))
    for name, weight in merged.items():
        torch.testing.assert_close(weight, expected[name], rtol=1e-6, atol=1e-6, msg=name)
    plain = load(model_dir, value_model)
    assert {name: w.shape for name, w in lora.merged_named_weights(plain)} == {
        name: w.shape for name, w in plain.state_dict().items()}


@pytest.mark.parametrize("value_model", [False, True])
def test_export_writes_merged_model_and_adapter_that_load_in_transformers(model_dir, value_model, tmp_path,
                                                                         one_rank):
    model = adapted(model_dir, value_model)
    engine.export_hf(model, load_tokenizer(model_dir), tmp_path, {"note": "exported"})
    expected = outputs(model, value_model)
    assert outputs(load(tmp_path, value_model), value_model).sub(expected).abs().max() < 1e-5
    with_adapter = PeftModel.from_pretrained(load(model_dir, value_model), tmp_path / lora.ADAPTER_DIR)
    assert outputs(with_adapter, value_model).sub(expected).abs().max() < 1e-5
    assert (tmp_path / lora.ADAPTER_DIR / "adapter_config.json").is_file()
