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
from stages.model_io import load_causal_lm, load_tokenizer, load_value_model
from stages.registry import STAGES
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
    cfg = parse_stage_args(STAGES["sft"], ["--config", "tiny", "--lora_rank", "4", "--lora_alpha", "8", *flags],
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
    assert lora.wrap(plain, parse_stage_args(STAGES["sft"], ["--config", "tiny"], require_inputs=False),
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


def adapter_gradients(model, value_model: bool) -> dict[str, torch.Tensor]:
    """Gradients of the trained parameters from one forward and backward of SEQUENCES."""
    model.zero_grad()
    ids = torch.tensor([SEQUENCES[0]])
    out = model(input_ids=ids)
    (out.logits.float().square().mean()).backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return gradients


@pytest.mark.parametrize("value_model", [False, True])
def test_4bit_weights_merge_dequantized_and_export_as_a_full_model(model_dir, value_model, tmp_path, one_rank):
    """--load_in_4bit (QLoRA): linear layers load as 4-bit NF4 (bitsandbytes), adapters train on top in bfloat16.
    The merged weights engines and outputs get are the dequantized base plus the adapter delta, under the full
    model's names and shapes; the output loads as a plain bfloat16 model that computes what the 4-bit one did."""
    from bitsandbytes.functional import dequantize_4bit

    flags = ["--config", "tiny", "--lora_rank", "4", "--lora_alpha", "8", "--load_in_4bit", "--bf16"]
    cfg = parse_stage_args(STAGES["sft"], flags, require_inputs=False)
    loader = load_value_model if value_model else load_causal_lm
    quantized = loader(model_dir, dtype=torch.bfloat16, load_in_4bit=True)
    q_proj = quantized.model.layers[0].self_attn.q_proj
    assert q_proj.weight.dtype == torch.uint8 and q_proj.weight.quant_state.quant_type == "nf4"
    torch.manual_seed(0)
    model = lora.wrap(quantized, cfg, value_model=value_model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.1 * torch.randn_like(param))
    assert all(p.dtype == torch.bfloat16 for name, p in model.named_parameters() if "lora_" in name)
    # A no-grad evaluation forward (a reference pass) leaves the 4-bit layers as they were: the adapters' gradients
    # and the merged weights after it are the ones before it.
    before = adapter_gradients(model, value_model)
    model.eval()
    outputs(model, value_model)
    model.train()
    after = adapter_gradients(model, value_model)
    for name, gradient in before.items():
        torch.testing.assert_close(after[name], gradient, msg=name)

    merged = dict(lora.merged_named_weights(model))
    full = load(model_dir, value_model).state_dict()
    assert {name: w.shape for name, w in merged.items()} == {name: w.shape for name, w in full.items()}
    layer = lora.hf_model(model).model.layers[0].self_attn.q_proj
    expected = (dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).float()
                + layer.get_delta_weight("default").float()).to(torch.bfloat16)
    torch.testing.assert_close(merged["model.layers[0].self_attn.q_proj.weight".replace("[0]", ".0")], expected)
    # Quantization moved the base weights a little from the full ones (NF4), not beyond a few percent.
    base = dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).float()
    assert 0 < (base - full["model.layers.0.self_attn.q_proj.weight"]).abs().mean() < 0.1 * full[
        "model.layers.0.self_attn.q_proj.weight"].abs().mean()

    engine.export_hf(model, load_tokenizer(model_dir), tmp_path)
    assert '"quantization_config"' not in (tmp_path / "config.json").read_text()
    assert '"dtype": "bfloat16"' in (tmp_path / "config.json").read_text()
    exported = load(tmp_path, value_model).to(torch.bfloat16)
    assert exported.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    difference = outputs(exported, value_model).float().sub(outputs(model, value_model).float()).abs().max()
    assert difference < 0.05, difference
