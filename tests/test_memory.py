"""pipeline/memory.py, term by term, on configs small enough to check by hand (GiB = 2**30 bytes)."""

from __future__ import annotations

import pytest

from pipeline import memory
from pipeline.memory import (
    ASLEEP_ENGINE_BYTES,
    CONTEXT_BYTES,
    GIB,
    ModelShape,
    forward_pass,
    frozen_memory,
    gathered_bytes,
    logits_bytes,
    reduce_bucket_bytes,
    rl_memory,
    trained_memory,
)
from stages.cli import parse_stage_args
from stages.registry import STAGES

# 1e9 parameters, h = 1000, 10 layers, V = 100: the embeddings 1e5 parameters, each layer (1e9 - 1e5) / 10.
SMALL = ModelShape(params=10**9, hidden=1000, layers=10, vocab=100)


def test_the_chunk_size_is_the_one_the_log_probs_use():
    from stages import algorithms

    assert memory.LOGITS_CHUNK_BYTES == algorithms.LOGITS_CHUNK_BYTES
    for vocab in (100, 32_000, 128_256, 10**9):
        assert memory.logits_chunk_positions(vocab) == algorithms.logits_chunk_positions(vocab)
    assert memory.logits_chunk_positions(128_256) == 523  # 268435456 // (4 * 128256)


def test_logits_bytes_worked_numbers():
    """V = 1000, 50 tokens in bf16: a chunk holds all 50 positions (50 × 1000 × 4 = 2e5 bytes of float32).
    Without gradients: the bf16 logits 50 × 1000 × 2 = 1e5, plus 2 chunks: 5e5. Training: the logits and their
    gradient 2e5, plus 4 chunks: 1e6. With the entropy in the loss: a second gradient (3e5) and 7 chunks: 1.7e6."""
    shape = ModelShape(params=10**6, hidden=10, layers=1, vocab=1000)
    assert logits_bytes(shape, 50, 2, grad=False) == 1e5 + 2 * 2e5
    assert logits_bytes(shape, 50, 2, grad=True) == 2e5 + 4 * 2e5
    assert logits_bytes(shape, 50, 2, grad=True, entropy=True) == 3e5 + 7 * 2e5
    assert logits_bytes(shape, 50, 2, grad=False, entropy=True) == 1e5 + 2 * 2e5  # no entropy without gradients
    assert logits_bytes(shape, 50, 4, grad=False) == 2e5 + 2 * 2e5  # fp32 logits
    # Llama-3's vocabulary, 32768 tokens: chunks of 523 positions (268,311,552 bytes of float32).
    llama = ModelShape(params=8 * 10**9, hidden=4096, layers=32, vocab=128_256)
    chunk = 523 * 128_256 * 4
    assert logits_bytes(llama, 32_768, 2, grad=False) == 32_768 * 128_256 * 2 + 2 * chunk
    assert logits_bytes(llama, 32_768, 2, grad=False) / GIB == pytest.approx(8.33, abs=0.01)
    assert logits_bytes(llama, 16_384, 2, grad=True) / GIB == pytest.approx(8.83, abs=0.01)


def test_reduce_bucket_is_deepspeeds_default_which_the_config_leaves_alone():
    """5e8 elements of the gradients' dtype: 1e9 bytes in bf16 (0.93 GiB), 2e9 in fp32, none at ZeRO-0."""
    assert reduce_bucket_bytes(2, 3) == reduce_bucket_bytes(2, 1) == 1e9
    assert reduce_bucket_bytes(4, 2) == 2e9 and reduce_bucket_bytes(2, 0) == 0.0
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    defaults = DeepSpeedZeroConfig()
    assert defaults.reduce_bucket_size == memory.REDUCE_BUCKET_ELEMENTS
    assert defaults.prefetch_bucket_size == memory.PREFETCH_BUCKET_ELEMENTS
    from types import SimpleNamespace

    from stages.engine import deepspeed_config

    cfg = SimpleNamespace(zero_stage=3, max_norm=1.0, bf16=True, adam_offload=False)
    zero = deepspeed_config(cfg, world_size=8, train_batch_size=8, micro_batch_size=1)["zero_optimization"]
    assert not {"reduce_bucket_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size"} & set(zero)


def test_zero3_gathered_weights_worked_numbers():
    """SMALL's largest module is a layer, (1e9 - 1e5) / 10 = 99,990,000 parameters: 199,980,000 bytes in bf16; a
    backward holds its gradient too; the prefetch bucket 5e7 × 2 = 1e8. Below ZeRO-3 nothing is gathered. A
    Llama-3-8B head (128256 × 4096) is larger than its layers: 1.0 GiB gathered."""
    assert gathered_bytes(SMALL, 2, 3, grad=False) == 199_980_000 + 1e8
    assert gathered_bytes(SMALL, 2, 3, grad=True) == 2 * 199_980_000 + 1e8
    assert gathered_bytes(SMALL, 2, 2, grad=True) == 0.0
    llama = ModelShape(params=8_030_261_248, hidden=4096, layers=32, vocab=128_256)
    assert gathered_bytes(llama, 2, 3, grad=False) == 128_256 * 4096 * 2 + 1e8


def test_activations_hold_the_checkpoints_and_the_larger_of_one_layer_and_the_logits():
    """100 tokens of SMALL in bf16 (h 1000, its MLP 4h wide with two matrices, no grouped heads): checkpoints
    10 × 100 × 1000 × 2 = 2e6, one layer recomputed and differentiated (12h + 2h + 3 × 4h) × 100 × 2 = 5.2e6, logits
    100 × 100 × 2 × 2 + 4 chunks of 4e4 = 2e5: the layer is the larger. Without checkpointing every layer keeps its
    5.2e6, and the logits come on top. A forward without gradients holds (4h + 2 × 4h) × 100 × 2 = 2.4e6."""
    common = dict(ranks=8, bf16=True, lora=False, tokens=100, with_logits=True, adam_offload=False)
    zero3 = trained_memory("actor", SMALL, zero_stage=3, gradient_checkpointing=True, **common)
    assert (zero3.checkpoints, zero3.layer, zero3.logits) == (2e6, 5.2e6, 2e5)
    assert zero3.activations == zero3.gathered + 2e6 + 5.2e6
    whole = trained_memory("actor", SMALL, zero_stage=2, gradient_checkpointing=False, **common)
    assert (whole.checkpoints, whole.layer, whole.gathered) == (10 * 5.2e6, 0.0, 0.0)
    assert whole.activations == 52e6 + 2e5  # the logits on top of every layer's
    # A vocabulary of 10^5: the logits (100 × 1e5 × 4 + 4 × 100 × 1e5 × 4 = 2e8) outweigh the layer.
    wide = trained_memory("actor", ModelShape(params=10**9, hidden=1000, layers=10, vocab=10**5), zero_stage=2,
                          gradient_checkpointing=True, **common)
    assert wide.logits == 2e8 and wide.activations == 2e6 + 2e8
    # The reference's forward without gradients: one layer, then the bf16 logits and 2 chunks.
    ref = frozen_memory("ref", SMALL, ranks=8, zero_stage=3, bf16=True, tokens=100, with_logits=True)
    assert (ref.checkpoints, ref.layer, ref.logits) == (0.0, 2.4e6, 100 * 100 * 2 + 2 * 4e4)
    # The actor's own forward for the experience: its bf16 weights and a frozen model's working memory.
    assert forward_pass(zero3, SMALL, zero_stage=3, bf16=True, tokens=100, with_logits=True).working == ref.working


def _llama_cfg(*flags: str):
    return parse_stage_args(STAGES["rl"], ["--config", "llama3-8b", *flags], require_inputs=False)


def test_engines_awake_asleep_and_per_gpu():
    """4 engines × TP 2 on 8 GPUs: one worker a GPU, 0.5 × 80 GiB awake, ASLEEP_ENGINE_BYTES asleep; 8 engines × TP 2
    put two workers on each GPU (two shares, two contexts)."""
    cfg = _llama_cfg()
    assert memory.engine_workers_per_gpu(cfg, 8) == 1
    assert memory.engine_workers_per_gpu(cfg.model_copy(update={"vllm_num_engines": 8}), 8) == 2
    [group] = rl_memory(cfg, {role: SMALL for role in ("actor", "critic", "ref", "reward")}, 80 * GIB)
    role = {m.role: m for m in group.members}
    assert role["engines"].engine == 40 * GIB
    # The reward model's forward: its working memory, the others resident, an asleep engine, two processes.
    others = role["actor"].weights + role["critic"].weights + role["ref"].weights
    assert group.phases["reward forward"] == role["reward"].working + others + ASLEEP_ENGINE_BYTES + 2 * CONTEXT_BYTES
    awake = cfg.model_copy(update={"vllm_enable_sleep": False})
    [awake_group] = rl_memory(awake, {role: SMALL for role in ("actor", "critic", "ref", "reward")}, 80 * GIB)
    assert awake_group.phases["reward forward"] == group.phases["reward forward"] - ASLEEP_ENGINE_BYTES + 40 * GIB


def test_phases_of_the_shared_gpus_worked_numbers():
    """SMALL for every role, ZeRO-3 over 8 ranks in bf16: per GPU a trained model's states are 2.5e8 weights,
    2.5e8 gradients, 1.5e9 Adam and the 1e9 bucket; a frozen one's 2.5e8 weights. Start-up: the engines awake
    (40 GiB), every state, two CUDA contexts. Generation: the engines and the bf16 weights (the trained models asleep
    keep theirs). The actor's training turn: its whole states and working memory, the others' weights, an asleep
    engine."""
    cfg = _llama_cfg()
    [group] = rl_memory(cfg, {role: SMALL for role in ("actor", "critic", "ref", "reward")}, 80 * GIB)
    role = {m.role: m for m in group.members}
    assert role["actor"].states == role["critic"].states == 2.5e8 + 2.5e8 + 1.5e9 + 1e9
    contexts = 2 * CONTEXT_BYTES
    # The engines started first and sleep while every model loads (stages/placement.py startup_order).
    assert group.phases["start-up"] == ASLEEP_ENGINE_BYTES + 2 * 3e9 + 2 * 2.5e8 + contexts
    assert group.phases["generation"] == 40 * GIB + 4 * 2.5e8 + contexts
    assert group.phases["actor training"] == role["actor"].working + 3 * 2.5e8 + ASLEEP_ENGINE_BYTES + contexts
    assert group.phases["actor forward"] == role["actor.fwd"].working + 3 * 2.5e8 + ASLEEP_ENGINE_BYTES + contexts
    assert group.peak_phase == "generation" and group.peak == group.phases["generation"]
    # Without --deepspeed_enable_sleep the trained models' whole states stay in every phase.
    awake = cfg.model_copy(update={"deepspeed_enable_sleep": False})
    [awake_group] = rl_memory(awake, {role: SMALL for role in ("actor", "critic", "ref", "reward")}, 80 * GIB)
    assert awake_group.phases["generation"] == 40 * GIB + 2 * 3e9 + 2 * 2.5e8 + contexts
    # Engines that do not sleep start beside the models: awake while every model loads.
    awake_engines = cfg.model_copy(update={"vllm_enable_sleep": False})
    [awake_group] = rl_memory(awake_engines, {role: SMALL for role in ("actor", "critic", "ref", "reward")}, 80 * GIB)
    assert awake_group.phases["start-up"] == 40 * GIB + 2 * 3e9 + 2 * 2.5e8 + contexts


def test_the_plan_refuses_a_preset_that_does_not_fit_naming_the_phase(monkeypatch):
    """llama3-8b on GPUs of 36 GiB: the actor's training turn needs about 39.4 (its states and working memory, the
    other models' weights, the asleep engines, two contexts) and is refused by name, start-up (38.5) named too; the
    engines' share scales with the GPU and fits."""
    from infra.settings import Settings
    from pipeline import plan
    from pipeline.config import load_pipeline_config, shape_inputs
    from tests.test_nightly import LLAMA3_8B

    monkeypatch.setattr(plan, "model_shape", lambda source: ModelShape.from_config(LLAMA3_8B))
    config = load_pipeline_config("llama3-8b")
    problems: list[str] = []
    table = plan.memory_plan(config, "rl", shape_inputs(config.shape), Settings(gpu_memory_gib=36), problems, [])
    assert len(problems) == 1 and "in the actor training phase" in problems[0] and "36 GiB" in problems[0], problems
    assert "(also over 36 GiB: start-up 38.5)" in problems[0]
    assert any(line.strip().startswith("phase start-up") for line in table)
    problems.clear()
    plan.memory_plan(config, "rl", shape_inputs(config.shape), Settings(gpu_memory_gib=80), problems, [])
    assert problems == []


def test_a_layers_activations_per_token_worked_numbers():
    """Llama-3-8B: h 4096, MLP 14336 with three matrices, 8 key/value heads of 128. Recomputed and differentiated:
    12 × 4096 + 2 × 1024 + 6 × 14336 = 137,216 values a token; a forward: 4 × 4096 + 3 × 14336 = 59,392. GPT-2's
    two-matrix MLP of 4h, no grouped heads: 12h + 2h + 12h = 26h and 4h + 8h = 12h."""
    llama = ModelShape.from_config({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                    "vocab_size": 128_256, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "intermediate_size": 14_336})
    assert (llama.intermediate, llama.kv_width, llama.gated_mlp) == (14_336, 1024, True)
    assert (llama.layer_values(grad=True), llama.layer_values(grad=False)) == (137_216, 59_392)
    assert llama.params == 8_030_261_248
    gpt2 = ModelShape.from_config({"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "vocab_size": 50_257,
                                   "n_head": 12})
    assert (gpt2.layer_values(grad=True), gpt2.layer_values(grad=False)) == (26 * 768, 12 * 768)
