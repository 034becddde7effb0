"""OpenRLHF's --aux_loss_coef: the load-balancing loss of mixture-of-experts routers, added to the training loss.

A MoE model (its config has `output_router_logits`: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) returns every
layer's router logits from its base model when asked. The forwards of stages/packing.py and of the RL roles
(stages/rl/actor.py, stages/rl/critic.py) return tensors, not HF outputs, so `router_aux_losses(model)` asks for the logits and catches them with hooks on the base
model, and computes each forward's loss with the architecture's own `load_balancing_loss_func`, as its CausalLM
computes `output.aux_loss`: with the forward's attention mask (padded forwards; packed ones have no padding and no
mask). Value models (reward model, critic), whose outputs carry no aux loss, get theirs the same way.

The logits are asked for per forward, not by setting `output_router_logits` in the config as OpenRLHF does: in the
config it would reach transformers' generate (whose cached decoding steps fail on it: the attention mask covers the
whole sequence, the router logits only the new token) and every exported config.json.
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from stages.errors import StageInputError

ROUTER_FLAG = "output_router_logits"
# Config names of a MoE layer's expert count, as transformers' MoE CausalLM classes read them (the first set wins).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")
LOSS_PARAMETERS = ["gate_logits", "num_experts", "top_k", "attention_mask"]

BalancingLoss = Callable[[tuple[torch.Tensor, ...], torch.Tensor | None], torch.Tensor]


def has_router(config) -> bool:
    """Whether a model config is a mixture-of-experts one: it has `output_router_logits` (OpenRLHF's test)."""
    return ROUTER_FLAG in config.to_dict()


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers base model (MixtralModel, ...) inside DeepSpeed, PEFT and value-model wrappers: the module
    whose output holds the router logits."""
    from transformers import PreTrainedModel

    hf_model = next((module for module in model.modules() if isinstance(module, PreTrainedModel)), None)
    if hf_model is None:
        raise ValueError(f"{type(model).__name__} holds no transformers model")
    return hf_model.base_model


def balancing_loss(base: torch.nn.Module) -> BalancingLoss:
    """loss(router_logits, attention_mask) of one forward of `base`: its architecture's load_balancing_loss_func
    with the expert count and top-k of its config. ValueError when the architecture has none this code can call."""
    config, name = base.config, type(base).__name__
    if not has_router(config):
        raise ValueError(f"{name} is not a mixture-of-experts model (its config has no {ROUTER_FLAG})")
    loss_func = getattr(sys.modules[type(base).__module__], "load_balancing_loss_func", None)
    num_experts = next((getattr(config, key) for key in EXPERT_COUNT_KEYS if getattr(config, key, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if (loss_func is None or list(inspect.signature(loss_func).parameters) != LOSS_PARAMETERS
            or not isinstance(num_experts, int) or not isinstance(top_k, int)):
        raise ValueError(f"{name}'s module has no load_balancing_loss_func({', '.join(LOSS_PARAMETERS)}) or its "
                         f"config no {' or '.join(EXPERT_COUNT_KEYS)} and num_experts_per_tok")
    return lambda router_logits, attention_mask: loss_func(router_logits, num_experts, top_k, attention_mask)


def no_router_error(aux_loss_coef: float, path: str | os.PathLike, why: str) -> StageInputError:
    return StageInputError(f"--aux_loss_coef {aux_loss_coef:g} weighs the load-balancing loss of mixture-of-experts "
                           f"routers, but model {path} has none: {why}; set --aux_loss_coef 0")


def check_config_router(aux_loss_coef: float, path: str) -> None:
    """The stage's process, before any rank starts (ranks would load the whole model first): refuse (exit 2) a
    positive --aux_loss_coef for a model in a local folder whose config is not a mixture-of-experts one. A model on
    S3 or the hub is left to the ranks' check_router: reading its config here would fetch the whole model into this
    process's node first."""
    folder = os.fspath(path).removeprefix("file://")
    if aux_loss_coef <= 0 or not os.path.isfile(os.path.join(folder, "config.json")):
        return
    from transformers import AutoConfig

    if not has_router(AutoConfig.from_pretrained(folder)):
        raise no_router_error(aux_loss_coef, path, f"its config has no {ROUTER_FLAG}")


def check_router(model: torch.nn.Module, aux_loss_coef: float, path: str | os.PathLike) -> None:
    """Refuse (exit 2) a positive --aux_loss_coef for a model without a load-balancing loss: the flag would add
    nothing. Called by each trained model's rank right after loading it, before training."""
    if aux_loss_coef <= 0:
        return
    try:
        balancing_loss(base_model(model))
    except ValueError as error:
        raise no_router_error(aux_loss_coef, path, str(error)) from None


@contextmanager
def router_aux_losses(model: torch.nn.Module, enabled: bool = True) -> Iterator[list[torch.Tensor]]:
    """The load-balancing loss of each forward of `model` inside the block, in order, with its autograd graph
    (an empty list when not `enabled`)."""
    losses: list[torch.Tensor] = []
    if not enabled:
        yield losses
        return
    base = base_model(model)
    loss = balancing_loss(base)

    def ask_for_logits(_module, args, kwargs):
        return args, {**kwargs, ROUTER_FLAG: True}

    def record(_module, _args, kwargs, output):
        losses.append(loss(output.router_logits, kwargs.get("attention_mask")))

    handles = [base.register_forward_pre_hook(ask_for_logits, with_kwargs=True),
               base.register_forward_hook(record, with_kwargs=True)]
    try:
        yield losses
    finally:
        for handle in handles:
            handle.remove()


def step_share(aux_losses: list[torch.Tensor], step_micro_batches: int) -> torch.Tensor:
    """A micro-batch's part of its optimizer step's mean load-balancing loss: the sum of its forwards' losses /
    the step's micro-batches over all ranks (a rank's micro-batches × ranks).

    OpenRLHF adds coef × aux to each micro-batch's loss, and DeepSpeed averages the gradients over the step's
    micro-batches (accumulation) and ranks: coef × the mean aux of the step. Here each micro-batch's loss is
    multiplied by ds.global_loss_scale (accumulation steps × ranks) to undo that averaging, because the task losses
    are already sums over a global count; an aux term divided by the step's micro-batches before that scaling comes
    out as OpenRLHF's mean. Summed over micro-batches and ranks like the other logged statistics, the shares are the
    step's mean aux loss.
    """
    return sum(aux_losses) / step_micro_batches
