"""GPU memory a stage needs per GPU, estimated from the model's config.json and the stage's settings (no torch).

What each model holds on a GPU, by role:
- trained (actor, critic, the supervised stages' model): weights, gradients and Adam states. With bf16 the
  weights and gradients take 2 bytes a parameter and Adam 12 (fp32 master copy, two moments); fp32 training 4, 4
  and 8. ZeRO-1 partitions the Adam states over the role's ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too;
  --adam_offload keeps the Adam states in host memory. LoRA (--lora_rank: the actor and the critic) trains adapters
  only: no gradients or Adam states of the base weights. --load_in_4bit keeps every model's linear layers in 4-bit
  NF4, about 0.52 bytes a parameter with its scales (embeddings and output head in bf16).
- frozen (reference, reward model): the weights (partitioned with ZeRO-3; with --ref_reward_offload the partitions
  stay in host memory and a forward gathers one layer at a time), and a forward's activations.
- engines (vLLM): --vllm_gpu_memory_utilization of each engine GPU, weights and KV cache together.
Activations of one training micro-batch of b sequences of s tokens (--use_dynamic_batch: its token budget for b·s),
hidden size h, L layers, vocabulary V: with gradient checkpointing each layer keeps its input (b·s·h values, 2 bytes
each with bf16, 4 in fp32) and one layer at a time is recomputed whole; without, each layer keeps about 17·b·s·h values (Korthikanti et al. 2022, with
FlashAttention's O(s) attention); the actor adds its logits and their fp32 log-softmax, b·s·V·(2 + 4) bytes.

With --colocate_all_models every model shares the same GPUs and the phases take turns (stages/placement.py): the
peak is the largest phase, each phase being its own model's working memory plus what stays resident. Engines
asleep (--vllm_enable_sleep) hold nothing outside generation, DeepSpeed asleep (--deepspeed_enable_sleep) moves a
trained model's states to host memory outside its turn; frozen models stay resident. Estimates, not measurements:
allocator fragmentation and CUDA context (about 1 GiB a process) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
# Architectures whose MLP has three matrices (gate, up, down) rather than two.
GATED_MLP = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2")
ACTIVATION_VALUES_PER_LAYER = 17  # ≈ 34 bytes per b·s·h in bf16, with O(s) attention
CONTEXT_GIB = 1.0  # CUDA context and allocator slack per process, said in the table


# NF4 with double quantization: 4 bits a weight, an 8-bit scale per block of 64, an fp32 scale per 256 of those.
NF4_BYTES = (4 + (8 + 32 / 256) / 64) / 8


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int
    embeddings: int = 0  # of `params`: the input embeddings and an untied output head (never quantized)

    def weight_bytes(self, bf16: bool, load_in_4bit: bool = False) -> float:
        """Bytes of the weights: 2 (bf16) or 4 a parameter; with --load_in_4bit the linear layers in NF4."""
        value_bytes = 2 if bf16 else 4
        if not load_in_4bit:
            return self.params * value_bytes
        return (self.params - self.embeddings) * NF4_BYTES + self.embeddings * value_bytes

    @classmethod
    def from_config(cls, config: dict) -> ModelShape:
        """Parameter count of a decoder from its HF config.json: embeddings, attention (grouped KV heads), MLP,
        norms, and the output head unless tied."""
        h = config.get("hidden_size") or config["n_embd"]
        layers = config.get("num_hidden_layers") or config["n_layer"]
        vocab = config["vocab_size"]
        heads = config.get("num_attention_heads") or config.get("n_head")
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or h // heads
        inner = config.get("intermediate_size") or config.get("n_inner") or 4 * h
        mlp = (3 if config.get("model_type") in GATED_MLP else 2) * h * inner
        attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
        per_layer = attention + mlp + 2 * h
        head = 0 if config.get("tie_word_embeddings", False) else vocab * h
        return cls(params=vocab * h + layers * per_layer + h + head, hidden=h, layers=layers, vocab=vocab,
                   embeddings=vocab * h + head)


@dataclass
class RoleMemory:
    """Bytes one GPU holds for one role: its states (weights, gradients, Adam) and its working memory."""

    role: str
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    engine: float = 0.0

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def working(self) -> float:
        return self.states + self.activations + self.engine


def _layer_activations(shape: ModelShape, tokens: int, value_bytes: int) -> float:
    """Bytes one layer keeps for backward (or a forward holds at a time) over `tokens` tokens."""
    return ACTIVATION_VALUES_PER_LAYER * tokens * shape.hidden * value_bytes


def _logits(shape: ModelShape, tokens: int, value_bytes: int) -> float:
    """Bytes of the logits of `tokens` tokens and their fp32 log-softmax."""
    return tokens * shape.vocab * (value_bytes + 4)


def trained_memory(role: str, shape: ModelShape, *, ranks: int, zero_stage: int, bf16: bool, adam_offload: bool,
                   lora: bool, gradient_checkpointing: bool, tokens: int, with_logits: bool,
                   load_in_4bit: bool = False) -> RoleMemory:
    """What a trained model holds on one GPU, its activations over a micro-batch of `tokens` tokens."""
    n, value_bytes = shape.params, 2 if bf16 else 4
    memory = RoleMemory(role)
    memory.weights = shape.weight_bytes(bf16, load_in_4bit) / (ranks if zero_stage == 3 else 1)
    if not lora:
        memory.gradients = n * value_bytes / (ranks if zero_stage >= 2 else 1)
        memory.optimizer = 0.0 if adam_offload else n * (12 if bf16 else 8) / (ranks if zero_stage >= 1 else 1)
    layer = _layer_activations(shape, tokens, value_bytes)
    kept = (shape.layers * tokens * shape.hidden * value_bytes + layer if gradient_checkpointing
            else shape.layers * layer)
    memory.activations = kept + (_logits(shape, tokens, value_bytes) if with_logits else 0)
    return memory


def frozen_memory(role: str, shape: ModelShape, *, ranks: int, zero_stage: int, bf16: bool, tokens: int,
                  with_logits: bool, offloaded: bool = False, load_in_4bit: bool = False) -> RoleMemory:
    """What a frozen model holds on one GPU, a forward over `tokens` tokens at a time. Offloaded (ZeRO-3 partitions
    in host memory: --ref_reward_offload) it holds one layer's gathered weights at a time."""
    value_bytes = 2 if bf16 else 4
    weights = shape.weight_bytes(bf16, load_in_4bit)
    memory = RoleMemory(role, weights=weights / shape.layers if offloaded
                        else weights / (ranks if zero_stage == 3 else 1))
    # A forward keeps one layer's activations at a time, plus the logits it reads log-probs from.
    memory.activations = (_layer_activations(shape, tokens, value_bytes)
                          + (_logits(shape, tokens, value_bytes) if with_logits else 0))
    return memory


def rl_memory(cfg, shapes: dict[str, ModelShape], gpu_bytes: float) -> list[tuple[str, list[RoleMemory], float]]:
    """[(GPU group, its roles, peak bytes per GPU)] of an RL config; `shapes` by role (actor, critic, ref,
    reward), a role without a shape is left out (said by the caller)."""
    seq_len = cfg.prompt_max_len + cfg.generate_max_len
    # Tokens per micro-batch: --use_dynamic_batch's budgets, else micro-batches of full-length sequences; each rank
    # of a ring (--ring_attn_size) runs its share of them (its layers' gathered keys and values are left out:
    # --ring_head_stride heads at a time, small beside the activations).
    ring = cfg.ring_attn_size
    train_tokens = -(-(cfg.train_token_budget or cfg.micro_train_batch_size * seq_len) // ring)
    rollout_tokens = -(-(cfg.rollout_token_budget or cfg.micro_rollout_batch_size * seq_len) // ring)
    ranks = cfg.role_ranks()
    common = {"zero_stage": cfg.zero_stage, "bf16": cfg.bf16, "load_in_4bit": cfg.load_in_4bit}
    roles: dict[str, RoleMemory] = {}
    for role in ("actor", "critic"):
        if role in ranks and role in shapes:
            roles[role] = trained_memory(
                role, shapes[role], ranks=ranks[role], adam_offload=cfg.adam_offload,
                lora=cfg.lora_rank > 0, gradient_checkpointing=cfg.gradient_checkpointing,
                tokens=train_tokens, with_logits=role == "actor", **common)
    for role in ("ref", "reward"):
        if role in ranks and role in shapes:
            roles[role] = frozen_memory(role, shapes[role], ranks=ranks[role], tokens=rollout_tokens,
                                        with_logits=role == "ref", offloaded=cfg.ref_reward_offload, **common)
    engines = RoleMemory("engines", engine=cfg.vllm_gpu_memory_utilization * gpu_bytes)
    if cfg.colocate_all_models:
        return [("shared by every model", [*roles.values(), engines], colocated_peak(cfg, roles, engines))]
    together = [["actor", "ref"]] if cfg.colocate_actor_ref else [["actor"], ["ref"]]
    together += [["critic", "reward"]] if cfg.colocate_critic_reward else [["critic"], ["reward"]]
    groups = []
    for members in together:
        present = [roles[name] for name in members if name in roles]
        if present:  # models on GPUs of their own run side by side
            groups.append((" + ".join(m.role for m in present), present, sum(m.working for m in present)))
    groups.append(("engines", [engines], engines.working))
    return groups


def colocated_peak(cfg, roles: dict[str, RoleMemory], engines: RoleMemory) -> float:
    """The largest phase on GPUs every model shares: each phase's own working memory plus what stays resident."""
    def resident(except_role: str) -> float:
        total = 0.0 if cfg.vllm_enable_sleep or except_role == "engines" else engines.engine
        for name, memory in roles.items():
            if name == except_role:
                continue
            trained = name in ("actor", "critic")
            total += 0.0 if trained and cfg.deepspeed_enable_sleep else memory.states
        return total

    phases = {"generation": engines.working + resident("engines")}
    phases.update({name: memory.working + resident(name) for name, memory in roles.items()})
    return max(phases.values())


def render(groups: list[tuple[str, list[RoleMemory], float]], gpu_bytes: float) -> list[str]:
    """Rows of the memory table in GiB."""
    def gib(value: float) -> str:
        return f"{value / GIB:6.1f}"

    lines = [f"  memory per GPU (GiB, of {gpu_bytes / GIB:.0f}; + ~{CONTEXT_GIB:g} per process for CUDA):",
             "    role       weights  grads  adam  activ  engine"]
    for where, members, peak in groups:
        for memory in members:
            lines.append(f"    {memory.role:<9} {gib(memory.weights)} {gib(memory.gradients)} {gib(memory.optimizer)}"
                         f" {gib(memory.activations)} {gib(memory.engine)}")
        lines.append(f"    peak on the GPUs {where}: {peak / GIB:.1f}")
    return lines
