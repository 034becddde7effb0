"""LoRA adapters (PEFT) for the training stages, and the full weights their outputs and rollout engines need.

A stage wraps the model it trains right after loading it, before DeepSpeed:

    model = lora.wrap(model, cfg, value_model=False)   # no-op with --lora_rank 0

so only the adapters (and, for a value model, its head) are trained. Outputs hold the merged model, loadable like
any HF model, and the adapter under `lora_adapter/` (`engine.export_hf` writes both). Rollout engines take merged
weights under HF names:

    for name, weight in lora.merged_named_weights(engine):   # every rank of the model iterates (ZeRO-3 gathers)
        ...

`merged_named_weights` also serves models without LoRA (plain HF names and weights), so callers need no branch, and
models on 4-bit weights (--load_in_4bit, QLoRA): their base weights come dequantized, in the compute dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path

import torch

ADAPTER_DIR = "lora_adapter"


def wrap(model, cfg, *, value_model: bool):
    """`model` with LoRA adapters from --lora_rank/--lora_alpha/--target_modules/--lora_dropout (PEFT); unchanged
    when --lora_rank is 0. A value model also trains its head (PEFT's modules_to_save): a fresh head has nothing
    to adapt."""
    if cfg.lora_rank == 0:
        return model
    from peft import LoraConfig, TaskType, get_peft_model

    targets = cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    config = LoraConfig(
        r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets,
        bias="none", task_type=TaskType.SEQ_CLS if value_model else TaskType.CAUSAL_LM,
    )
    model = get_peft_model(model, config)
    if getattr(cfg, "load_in_4bit", False):
        cast_for_4bit(model)
    return model


def cast_for_4bit(model) -> None:
    """Adapters on 4-bit weights in bfloat16, the compute dtype of those layers and the dtype of every other weight
    (PEFT makes adapters float32): the dtypes a bf16 DeepSpeed engine holds OpenRLHF's QLoRA model in."""
    from peft.tuners.lora import LoraLayer

    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.lora_A.to(torch.bfloat16)
            module.lora_B.to(torch.bfloat16)


def full_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight's full values: a 4-bit one (--load_in_4bit, bitsandbytes) dequantized to its compute dtype."""
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is None:
        return weight
    from bitsandbytes.functional import dequantize_4bit

    return dequantize_4bit(weight.data, quant_state)


def _unwrap(model):
    """The PEFT model or HF model inside a DeepSpeed engine."""
    return getattr(model, "module", model)


def is_lora(model) -> bool:
    return hasattr(_unwrap(model), "peft_config")


def hf_model(model):
    """The HF model inside a DeepSpeed engine and/or PEFT wrapper (with PEFT, its layers hold the adapters)."""
    module = _unwrap(model)
    return module.get_base_model() if is_lora(model) else module


def _gathered(params: list[torch.nn.Parameter]):
    """Full values of ZeRO-3-partitioned parameters inside the context (a collective: every rank enters it)."""
    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return nullcontext()


def merged_named_weights(model, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full weight) of every entry of the HF model's state dict, LoRA merged into the base weights and
    PEFT's name parts (base_model.model., base_layer, modules_to_save) removed, copied to `device`.

    One module at a time is gathered under ZeRO-3, so peak memory stays near one layer. Every rank of the model
    must run the iteration to the end (the gathers are collectives); all ranks get the same values.
    """
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    done: list[str] = []  # modules yielded whole: their submodules are not visited again
    for prefix, module in hf_model(model).named_modules():
        if any(prefix.startswith(f"{name}.") for name in done):
            continue
        name_of = (lambda key: f"{prefix}.{key}") if prefix else (lambda key: key)
        if isinstance(module, LoraLayer):
            done.append(prefix)
            base = module.get_base_layer()
            with _gathered(list(module.parameters())), torch.no_grad():
                base_weight = full_weight(base.weight)
                weight = base_weight.float()
                if not module.merged:
                    for adapter in module.active_adapters:
                        if adapter in module.lora_A:
                            weight = weight + module.get_delta_weight(adapter).float()
                yield name_of("weight"), weight.to(base_weight.dtype).to(device, copy=True)
                if base.bias is not None:
                    yield name_of("bias"), base.bias.detach().to(device, copy=True)
        elif isinstance(module, ModulesToSaveWrapper):
            done.append(prefix)
            trained = module.modules_to_save[module.active_adapters[0]]
            with _gathered(list(trained.parameters())):
                for key, tensor in trained.state_dict().items():
                    yield name_of(key), tensor.detach().to(device, copy=True)
        else:
            entries = {key: p for key, p in module.named_parameters(recurse=False)}
            entries |= {key: b for key, b in module.named_buffers(recurse=False)
                        if key not in module._non_persistent_buffers_set}
            with _gathered([p for p in entries.values() if isinstance(p, torch.nn.Parameter)]), torch.no_grad():
                for key, tensor in entries.items():
                    yield name_of(key), full_weight(tensor).detach().to(device, copy=True)


def adapter_state(model) -> dict[str, torch.Tensor]:
    """The trained parameters of a PEFT model (adapters, value head), full and on CPU, under PEFT's names.

    A collective under ZeRO-3: every rank calls it.
    """
    module = _unwrap(model)
    trained = {name: p for name, p in module.named_parameters() if p.requires_grad}
    with _gathered(list(trained.values())):
        return {name: p.detach().to("cpu", copy=True) for name, p in trained.items()}


def save_adapter(model, out_dir: str | os.PathLike, state: dict[str, torch.Tensor]) -> Path:
    """Write the adapter (adapter_config.json + adapter_model.safetensors) that PeftModel.from_pretrained loads
    onto the base model."""
    out = Path(out_dir)
    _unwrap(model).save_pretrained(out, state_dict=state)
    return out
