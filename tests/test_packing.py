"""Packed (padding-free) and padded forwards agree: log-probs, values, every stage's loss and its gradient.

The stage workers run their real micro-batch loss on the tiny model (fp32, no DeepSpeed, one gloo rank), once with
--packing_samples and once without. Tolerance, relative to the largest value compared: 1e-5 for log-probs, values
and losses, 1e-4 for each parameter's gradient (float rounding of a different attention layout, measured up to
about 2e-5; a wrong mask or position id gives differences of order 1).
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from stages import data, lora, packing
from stages.cli import parse_stage_args
from stages.dpo import train as dpo
from stages.kto import train as kto
from stages.registry import STAGES
from stages.reward_model import train as reward_model
from stages.sft import train as sft

TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tolerance: float = TOLERANCE) -> None:
    scale = max(float(expected.abs().max()), 1e-3)
    difference = float((actual - expected).abs().max())
    assert difference <= tolerance * scale, f"{what}: max difference {difference:.3e} (scale {scale:.3e})"


def test_packing_lays_sequences_end_to_end_with_restarting_positions():
    input_ids, position_ids, starts = packing.pack([[5, 6, 7], [8], [9, 10]])
    assert input_ids.tolist() == [[5, 6, 7, 8, 9, 10]]
    assert position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert starts == [0, 3, 4]
    with pytest.raises(ValueError, match="no empty"):
        packing.pack([[1], []])


def test_packed_forward_equals_each_sequence_alone(assets, tokenizer):
    rows = data.load_rows(str(assets["sft_train"]), max_samples=6)
    sequences = [e["input_ids"] for e in data.encode_sft(
        rows, tokenizer, input_key="prompt", output_key="response", apply_chat_template=True, max_len=64).kept()]
    sequences[1] = sequences[1][:3]  # ragged lengths, including a short one
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    value_model = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1)
    with torch.no_grad():
        packed = packing.packed_log_probs(model, sequences)
        padded = packing.padded_log_probs(model, sequences, tokenizer.pad_token_id)
        packed_values = packing.packed_values(value_model, sequences)
        for index, seq in enumerate(sequences):
            alone = packing.padded_log_probs(model, [seq], tokenizer.pad_token_id)[0]
            assert packed[index].shape == (len(seq) - 1,)
            assert_close(packed[index], alone, f"log-probs of sequence {index}")
            assert_close(padded[index], alone, f"padded log-probs of sequence {index}")
            assert_close(packed_values[index], packing.padded_values(value_model, [seq], 0)[0], f"values {index}")
        rewards = packing.last_token_values(value_model, sequences, pad_token_id=tokenizer.pad_token_id, packing=True)
        assert_close(rewards, torch.stack([v[-1] for v in packed_values]), "rewards")
        # Without restarting positions the sequences would attend to each other: the check above is not vacuous.
        flat = torch.tensor([[t for seq in sequences for t in seq]])
        joined = model(input_ids=flat, use_cache=False).logits[0, len(sequences[0]) : len(sequences[0]) + 1]
        restarted = model(input_ids=flat, position_ids=packing.pack(sequences)[1], use_cache=False).logits[0]
        assert float((joined - restarted[len(sequences[0])]).abs().max()) > 0.01


def worker(stage_module, worker_cls, cfg, tokenizer, model, reference=None):
    """A stage worker without Ray or DeepSpeed: its real micro-batch loss on a plain model."""
    instance = worker_cls.__new__(worker_cls)
    instance.cfg, instance.tokenizer, instance.engine = cfg, tokenizer, model
    instance.rank, instance.world_size, instance.device = 0, 1, "cpu"
    if reference is not None:
        instance.reference = reference
    return instance


STAGE_DATA = {
    "sft": (sft, sft.SFTWorker, "sft_train", []),
    "reward_model": (reward_model, reward_model.RewardModelWorker, "pref_train", []),
    "dpo": (dpo, dpo.DPOWorker, "pref_train", ["--nll_loss_coef", "0.5"]),
    "kto": (kto, kto.KTOWorker, "kto_train", []),
}


@pytest.mark.parametrize("lora_rank", [0, 4])
@pytest.mark.parametrize("stage", list(STAGE_DATA))
def test_stage_loss_and_gradient_are_the_same_packed_and_padded(stage, lora_rank, assets, tokenizer, one_rank):
    module, worker_cls, dataset, flags = STAGE_DATA[stage]
    cfg = parse_stage_args(STAGES[stage], ["--config", "tiny", "--pretrain", str(assets["model"]), "--dataset",
                                   str(assets[dataset]), "--max_len", "64", *flags]
                           + (["--lora_rank", str(lora_rank)] if lora_rank else []))
    examples = module.encode_rows(cfg, tokenizer, data.load_rows(str(assets[dataset]), max_samples=8)).kept()
    torch.manual_seed(0)
    if stage == "reward_model":
        base = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1)
    else:
        base = AutoModelForCausalLM.from_pretrained(assets["model"])
    model = lora.wrap(base, cfg, value_model=stage == "reward_model")
    with torch.no_grad():  # move the policy away from the reference, so that DPO/KTO terms are not all zero
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.add_(0.02 * torch.randn_like(param))
    reference = AutoModelForCausalLM.from_pretrained(assets["model"]).eval() if stage in ("dpo", "kto") else None
    results = {}
    for packing_samples in (False, True):
        trained = copy.deepcopy(model).train()
        instance = worker(module, worker_cls, cfg.model_copy(update={"packing_samples": packing_samples}),
                          tokenizer, trained, reference)
        normalizer = instance.step_normalizer(examples)
        loss, stats = instance.micro_batch_loss(examples, normalizer)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in trained.named_parameters() if p.grad is not None}
        results[packing_samples] = (loss.detach(), stats, grads)
    (padded_loss, padded_stats, padded_grads), (packed_loss, packed_stats, packed_grads) = results[False], results[True]
    assert padded_loss.item() > 0 and padded_grads, stage
    assert_close(packed_loss, padded_loss, f"{stage} loss")
    assert packed_grads.keys() == padded_grads.keys()
    for name in padded_grads:
        assert_close(packed_grads[name], padded_grads[name], f"{stage} gradient of {name}", GRADIENT_TOLERANCE)
    assert packed_stats["tokens"] == padded_stats["tokens"] > 0
