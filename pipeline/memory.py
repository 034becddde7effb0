"""GPU memory a stage needs per GPU, estimated from the model's config.json and the stage's settings (no torch).

What each model holds on a GPU, by role (RoleMemory, bytes per GPU):
- trained (actor, critic): weights, gradients and Adam states. With bf16 the weights and gradients take 2 bytes a
  parameter (DeepSpeed accumulates gradients in the model's dtype: runtime/engine.py get_data_types) and Adam 12
  (fp32 master copy, two moments); fp32 training 4, 4 and 8. ZeRO-1 partitions the Adam states over the role's
  ranks, ZeRO-2 the gradients too, ZeRO-3 the weights too; --adam_offload keeps the Adam states in host memory.
  LoRA (--lora_rank) trains adapters only: no gradients or Adam states of the base weights. --load_in_4bit keeps
  the linear layers in 4-bit NF4, about 0.52 bytes a parameter with its scales (embeddings and head in bf16).
  ZeRO's reduce bucket: stages/engine.py deepspeed_config sets no reduce_bucket_size, so DeepSpeed's default
  5e8 elements in the gradients' dtype (0.93 GiB in bf16); ZeRO-3 allocates it when the optimizer is built
  (zero/stage3.py, "IPG"), ZeRO-1/2 in the first backward; it stays until offload_states (contiguous_grad_buffer).
- frozen (reference, reward model): the weights (partitioned with ZeRO-3; with --ref_reward_offload the partitions
  stay in host memory and a forward gathers one layer at a time).
- ZeRO-3 gathers each module's weights for its forward (the largest: the embedding or the output head, V·h
  values) and prefetches the next ones (stage3_prefetch_bucket_size, default 5e7 elements); a backward also holds
  the gathered module's full gradient before it is reduce-scattered.
- engines (vLLM): awake, --vllm_gpu_memory_utilization of the GPU per engine worker on it (weights, KV cache,
  CUDA graphs, activations: vLLM sizes its KV cache to fill that share). Asleep (--vllm_enable_sleep, level 1:
  vllm/device_allocator/sleep_mode_backend.py suspend) the weights, the runtime buffers and the CUDA-graph pool
  are copied to host memory and the KV cache is discarded; what vLLM allocated outside its cumem pools stays on the
  GPU: NCCL and custom all-reduce buffers (TP > 1), the model runner's persistent buffers, the caching allocator's
  leftovers. ASLEEP_ENGINE_BYTES per worker, an estimate (not measured), plus the worker's CUDA context.

Activations of one micro-batch of `tokens` tokens (b·s, or --use_dynamic_batch's token budget), hidden size h, L
layers, MLP width I, key/value width kv, vocabulary V, in values of 2 bytes (bf16) or 4 (fp32): with gradient
checkpointing each layer keeps its input (tokens·h) and one layer at a time is recomputed and differentiated, which
peaks at 12h + 2kv + 6I per token with a gated MLP (what autograd saves: the two RMSNorms' float32 inputs and
outputs, q, k, v, the attention's output and o_proj's input, gate, up, silu(gate) and their product, 11h + 2kv + 4I;
then the backward's gradients of the MLP's tensors and the hidden state) and 12h + 2kv + 3I with two matrices;
without checkpointing every layer keeps that. A forward without gradients holds one layer at a time: 4h + 3I
(gated) or 4h + 2I. Measured on an H200 against torch.cuda.max_memory_allocated (tests/test_gpu.py: 0.98 to 1.06 of
the plan on Llama shapes of I/h 2.75 to 4 with grouped heads, Llama-3-8B's width among them; the test allows 15%).

Logits (stages/algorithms.py computes log-probs and entropy in chunks of positions): the model's forward gives
bf16 logits, tokens·V·2 bytes (the head does not upcast: transformers' LlamaForCausalLM.forward); without
gradients that is all besides one chunk. Training keeps them for the backward and writes their gradient into one
tensor of the same size (2 more bytes); with an entropy term in the loss (--entropy_loss_coef) a second gradient
exists until the two are summed (2 more). Each chunk's float32 copy and its temporaries come on top:
CHUNK_COPIES copies of LOGITS_CHUNK_BYTES (measured with torch's profiler on CPU: tests/test_algorithms.py). The
logits exist after the last layer and are gone before the backward recomputes the layers, so a pass holds the
checkpoints plus the larger of one layer and the logits.

Per GPU and per phase (rl_memory): with --colocate_all_models every model shares the same GPUs and the phases take
turns (stages/placement.py): start-up (every model loads and builds, the trained models' states go to host memory
with --deepspeed_enable_sleep only once started, driver.offload_trained_states; with --vllm_enable_sleep the engines
started first and sleep meanwhile, stages/placement.py startup_order, else they are awake), generation, then each model's forward or training turn; each phase is its
own working memory plus what stays resident (a trained model asleep keeps its bf16 weights: offload_states leaves
lp_params on the GPU, stages/rl/actor.py). Every process on a GPU adds its CUDA context (CONTEXT_BYTES). Estimates,
not measurements: allocator fragmentation comes on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stages.placement import startup_order

GIB = 2**30
# Architectures whose MLP has three matrices (gate, up, down) rather than two.
GATED_MLP = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo2")
CONTEXT_BYTES = 1.0 * GIB  # CUDA context and allocator slack per process on a GPU
# stages/algorithms.py LOGITS_CHUNK_BYTES (a test checks they agree): one chunk's float32 copy of the logits.
LOGITS_CHUNK_BYTES = 256 * 2**20
# Float32 chunk-sized tensors alive at once, by (gradients, entropy as well): measured with torch's profiler on CPU
# (tests/test_algorithms.py: log-probs 2 without gradients, 4 forward + backward; entropy 3 and 7).
CHUNK_COPIES = {(False, False): 2, (False, True): 3, (True, False): 4, (True, True): 7}
# DeepSpeed's defaults (deepspeed/runtime/zero/config.py), which stages/engine.py deepspeed_config does not change.
REDUCE_BUCKET_ELEMENTS = 500_000_000
PREFETCH_BUCKET_ELEMENTS = 50_000_000
# What an asleep vLLM worker keeps on its GPU besides its CUDA context (see above; not measured).
ASLEEP_ENGINE_BYTES = 1.0 * GIB


# NF4 with double quantization: 4 bits a weight, an 8-bit scale per block of 64, an fp32 scale per 256 of those.
NF4_BYTES = (4 + (8 + 32 / 256) / 64) / 8


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int
    vocab: int
    embeddings: int = 0  # of `params`: the input embeddings and an untied output head (never quantized)
    intermediate: int = 0  # the MLP's width (0: 4 × hidden)
    kv_width: int = 0  # key/value heads × head size (0: hidden, no grouped heads)
    gated_mlp: bool = False  # gate, up and down matrices (Llama) rather than two

    def layer_values(self, grad: bool) -> int:
        """Values per token one decoder layer holds at its peak (the module docstring's activations): its
        recomputation and backward under gradient checkpointing, or a forward without gradients."""
        h, inner, kv = self.hidden, self.intermediate or 4 * self.hidden, self.kv_width or self.hidden
        if grad:
            return 12 * h + 2 * kv + (6 if self.gated_mlp else 3) * inner
        return 4 * h + (3 if self.gated_mlp else 2) * inner

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
                   embeddings=vocab * h + head, intermediate=inner, kv_width=kv_heads * head_dim,
                   gated_mlp=config.get("model_type") in GATED_MLP)


@dataclass
class RoleMemory:
    """Bytes one GPU holds for one role: its states (weights, gradients, Adam, ZeRO's reduce bucket), resident until
    offloaded, and the working memory of its pass: ZeRO-3's gathered weights, the layer checkpoints, one layer's
    activations and the logits (the larger of those two at a time), or an engine's share."""

    role: str
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    bucket: float = 0.0
    gathered: float = 0.0
    checkpoints: float = 0.0
    layer: float = 0.0
    logits: float = 0.0
    engine: float = 0.0

    @property
    def states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.bucket

    @property
    def activations(self) -> float:
        """Peak of a pass beyond the states: the logits exist between the last layer and the layers' recomputation."""
        return self.gathered + self.checkpoints + max(self.layer, self.logits)

    @property
    def working(self) -> float:
        return self.states + self.activations + self.engine


def _layer_activations(shape: ModelShape, tokens: int, value_bytes: int, grad: bool) -> float:
    """Bytes one layer holds at its peak over `tokens` tokens: recomputed and differentiated, or a forward."""
    return shape.layer_values(grad) * tokens * value_bytes


def logits_chunk_positions(vocab: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """stages/algorithms.py logits_chunk_positions: positions whose float32 logits fit in one chunk."""
    return max(1, chunk_bytes // (4 * max(vocab, 1)))


def logits_bytes(shape: ModelShape, tokens: int, value_bytes: int, *, grad: bool, entropy: bool = False) -> float:
    """Peak bytes of the logits of `tokens` tokens through the chunked log-prob (and entropy) pass: the logits in
    the model's dtype, with gradients their gradient (and the entropy's second one), plus CHUNK_COPIES float32
    chunks of at most `tokens` positions."""
    copies = 1 + (1 + int(entropy) if grad else 0)
    chunk = min(logits_chunk_positions(shape.vocab), tokens) * shape.vocab * 4
    return tokens * shape.vocab * value_bytes * copies + CHUNK_COPIES[(grad, entropy and grad)] * chunk


def reduce_bucket_bytes(value_bytes: int, zero_stage: int) -> float:
    """ZeRO's gradient reduce bucket of a trained model (none at ZeRO-0)."""
    return REDUCE_BUCKET_ELEMENTS * value_bytes if zero_stage >= 1 else 0.0


def gathered_bytes(shape: ModelShape, value_bytes: int, zero_stage: int, *, grad: bool) -> float:
    """ZeRO-3: the largest module gathered whole (the embedding or head, V·h, or one layer), its full gradient in a
    backward, and the prefetch bucket; nothing below ZeRO-3 (the weights are whole already)."""
    if zero_stage != 3:
        return 0.0
    layer = (shape.params - shape.vocab * shape.hidden) / shape.layers
    largest = max(shape.vocab * shape.hidden, layer) * value_bytes
    return largest * (2 if grad else 1) + PREFETCH_BUCKET_ELEMENTS * value_bytes


def trained_memory(role: str, shape: ModelShape, *, ranks: int, zero_stage: int, bf16: bool, adam_offload: bool,
                   lora: bool, gradient_checkpointing: bool, tokens: int, with_logits: bool,
                   load_in_4bit: bool = False, entropy: bool = False) -> RoleMemory:
    """What a trained model holds on one GPU, training on a micro-batch of `tokens` tokens."""
    n, value_bytes = shape.params, 2 if bf16 else 4
    memory = RoleMemory(role)
    memory.weights = shape.weight_bytes(bf16, load_in_4bit) / (ranks if zero_stage == 3 else 1)
    if not lora:
        memory.gradients = n * value_bytes / (ranks if zero_stage >= 2 else 1)
        memory.optimizer = 0.0 if adam_offload else n * (12 if bf16 else 8) / (ranks if zero_stage >= 1 else 1)
    memory.bucket = reduce_bucket_bytes(value_bytes, zero_stage)
    memory.gathered = gathered_bytes(shape, value_bytes, zero_stage, grad=True)
    layer = _layer_activations(shape, tokens, value_bytes, grad=True)
    if gradient_checkpointing:
        memory.checkpoints, memory.layer = shape.layers * tokens * shape.hidden * value_bytes, layer
    else:
        memory.checkpoints = shape.layers * layer
    if with_logits:
        memory.logits = logits_bytes(shape, tokens, value_bytes, grad=True, entropy=entropy)
    return memory


def frozen_memory(role: str, shape: ModelShape, *, ranks: int, zero_stage: int, bf16: bool, tokens: int,
                  with_logits: bool, offloaded: bool = False, load_in_4bit: bool = False) -> RoleMemory:
    """What a frozen model holds on one GPU, a forward over `tokens` tokens at a time. Offloaded (ZeRO-3 partitions
    in host memory: --ref_reward_offload) it holds one layer's gathered weights at a time."""
    value_bytes = 2 if bf16 else 4
    weights = shape.weight_bytes(bf16, load_in_4bit)
    memory = RoleMemory(role, weights=weights / shape.layers if offloaded
                        else weights / (ranks if zero_stage == 3 else 1))
    if not offloaded:
        memory.gathered = gathered_bytes(shape, value_bytes, zero_stage, grad=False)
    # A forward keeps one layer's activations at a time, then the logits it reads log-probs from.
    memory.layer = _layer_activations(shape, tokens, value_bytes, grad=False)
    if with_logits:
        memory.logits = logits_bytes(shape, tokens, value_bytes, grad=False)
    return memory


def forward_pass(trained: RoleMemory, shape: ModelShape, *, zero_stage: int, bf16: bool, tokens: int,
                 with_logits: bool) -> RoleMemory:
    """A trained model's forward without gradients (the actor's log-probs, the critic's values of the experience):
    its bf16 weights (under --deepspeed_enable_sleep the rest of its states stay in host memory) and a frozen
    model's working memory."""
    value_bytes = 2 if bf16 else 4
    memory = RoleMemory(f"{trained.role}.fwd", weights=trained.weights,
                        gathered=gathered_bytes(shape, value_bytes, zero_stage, grad=False),
                        layer=_layer_activations(shape, tokens, value_bytes, grad=False))
    if with_logits:
        memory.logits = logits_bytes(shape, tokens, value_bytes, grad=False)
    return memory


@dataclass
class GpuGroup:
    """GPUs running the same models: what each model holds there, and bytes per GPU by phase."""

    where: str
    members: list[RoleMemory]
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)


def engine_workers_per_gpu(cfg, gpus: int) -> int:
    """vLLM workers (one per engine and tensor-parallel rank) on each of `gpus` GPUs."""
    return -(-cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size // max(gpus, 1))


def rl_memory(cfg, shapes: dict[str, ModelShape], gpu_bytes: float) -> list[GpuGroup]:
    """Per-GPU memory of an RL config, by GPU group and phase; `shapes` by role (actor, critic, ref, reward), a role
    without a shape is left out (said by the caller)."""
    seq_len = cfg.prompt_max_len + cfg.generate_max_len
    # Tokens per micro-batch: --use_dynamic_batch's budgets, else micro-batches of full-length sequences; each rank
    # of a ring (--ring_attn_size) runs its share of them (its layers' gathered keys and values are left out:
    # --ring_head_stride heads at a time, small beside the activations).
    ring = cfg.ring_attn_size
    train_tokens = -(-(cfg.train_token_budget or cfg.micro_train_batch_size * seq_len) // ring)
    rollout_tokens = -(-(cfg.rollout_token_budget or cfg.micro_rollout_batch_size * seq_len) // ring)
    ranks = cfg.role_ranks()
    common = {"zero_stage": cfg.zero_stage, "bf16": cfg.bf16}
    roles: dict[str, RoleMemory] = {}
    forwards: dict[str, RoleMemory] = {}
    for role in ("actor", "critic"):
        if role in ranks and role in shapes:
            roles[role] = trained_memory(
                role, shapes[role], ranks=ranks[role], adam_offload=cfg.adam_offload,
                lora=cfg.lora_rank > 0, gradient_checkpointing=cfg.gradient_checkpointing, tokens=train_tokens,
                with_logits=role == "actor", load_in_4bit=cfg.load_in_4bit,
                entropy=role == "actor" and cfg.entropy_loss_coef is not None, **common)
            forwards[role] = forward_pass(roles[role], shapes[role], tokens=rollout_tokens,
                                          with_logits=role == "actor", **common)
    for role in ("ref", "reward"):
        if role in ranks and role in shapes:
            roles[role] = frozen_memory(role, shapes[role], ranks=ranks[role], tokens=rollout_tokens,
                                        with_logits=role == "ref", offloaded=cfg.ref_reward_offload,
                                        load_in_4bit=cfg.load_in_4bit, **common)
    if cfg.colocate_all_models:
        return [colocated_phases(cfg, roles, forwards, gpu_bytes)]
    together = [["actor", "ref"]] if cfg.colocate_actor_ref else [["actor"], ["ref"]]
    together += [["critic", "reward"]] if cfg.colocate_critic_reward else [["critic"], ["reward"]]
    groups = []
    for members in together:
        present = [roles[name] for name in members if name in roles]
        if present:  # models on GPUs of their own run side by side, each in its own process
            running = sum(max(m.working, m.states + forwards[m.role].activations) if m.role in forwards
                          else m.working for m in present)
            groups.append(GpuGroup(" + ".join(m.role for m in present), present,
                                   {"running": running + len(present) * CONTEXT_BYTES}))
    workers = engine_workers_per_gpu(cfg, cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size)
    engines = RoleMemory("engines", engine=cfg.vllm_gpu_memory_utilization * gpu_bytes * workers)
    groups.append(GpuGroup("engines", [engines], {"generation": engines.engine + workers * CONTEXT_BYTES}))
    return groups


def colocated_phases(cfg, roles: dict[str, RoleMemory], forwards: dict[str, RoleMemory],
                     gpu_bytes: float) -> GpuGroup:
    """--colocate_all_models: every phase on the shared GPUs, its own working memory plus what stays resident."""
    ranks = cfg.role_ranks()
    gpus = max([*ranks.values(), cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size])
    workers = engine_workers_per_gpu(cfg, gpus)
    awake = cfg.vllm_gpu_memory_utilization * gpu_bytes * workers
    asleep = ASLEEP_ENGINE_BYTES * workers if cfg.vllm_enable_sleep else awake
    engines = RoleMemory("engines", engine=awake)
    # One process per rank holds every model (stages/placement.py rank_processes; one per model with
    # --async_train), and one per engine worker.
    processes = (len(roles) if cfg.async_train else 1) + workers
    contexts = processes * CONTEXT_BYTES

    def resident(name: str) -> float:
        memory = roles[name]
        trained = name in ("actor", "critic")
        return memory.weights if trained and cfg.deepspeed_enable_sleep else memory.states

    def others(except_role: str) -> float:
        return sum(resident(name) for name in roles if name != except_role)

    # Start-up: every model loads and builds, the trained models' whole states on the GPUs until
    # driver.offload_trained_states, beside the engines: asleep already where they start first (startup_order),
    # else awake.
    at_startup = asleep if startup_order(cfg, "cuda")[0] == "engines" else awake
    phases = {"start-up": at_startup + sum(memory.states for memory in roles.values()) + contexts,
              "generation": awake + others("") + contexts}
    for name, memory in forwards.items():
        phases[f"{name} forward"] = memory.working + others(name) + asleep + contexts
    for name, memory in roles.items():
        phases[f"{name} training" if name in forwards else f"{name} forward"] = (
            memory.working + others(name) + asleep + contexts)
    return GpuGroup("shared by every model", [*roles.values(), *forwards.values(), engines], phases)


def render(groups: list[GpuGroup], gpu_bytes: float) -> list[str]:
    """Rows of the memory table in GiB: what each model holds, then each GPU group's phases."""
    def gib(value: float) -> str:
        return f"{value / GIB:6.1f}"

    lines = [f"  memory per GPU (GiB, of {gpu_bytes / GIB:.0f}; CUDA contexts {CONTEXT_BYTES / GIB:g} per process"
             " in the phases):",
             "    role        weights  grads  adam bucket gather  ckpts  layer logits engine"]
    for group in groups:
        for m in group.members:
            lines.append(f"    {m.role:<10} " + " ".join(gib(v) for v in (
                m.weights, m.gradients, m.optimizer, m.bucket, m.gathered, m.checkpoints, m.layer, m.logits,
                m.engine)))
        for phase, total in group.phases.items():
            lines.append(f"    phase {phase:<18} {total / GIB:6.1f}")
        lines.append(f"    peak on the GPUs {group.where}: {group.peak / GIB:.1f} ({group.peak_phase})")
    return lines
