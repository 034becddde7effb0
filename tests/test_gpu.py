"""Checks of the GPU-only code paths on one CUDA GPU, with PyTorch and transformers alone (no vLLM, Ray or
DeepSpeed): `python -m pytest -m gpu -n 0 tests/test_gpu.py` (a few minutes). Skipped where CUDA is not available.

Each test writes its measurements as JSON into $RLHF_GPU_TEST_OUTPUT (default test-output/gpu/):
- ipc: CUDA IPC buckets between two processes with stages/rl/weight_sync.py's share_bucket / open_shared;
- plan_memory: pipeline/memory.py's logits and checkpointed-activation terms against torch.cuda.max_memory_allocated;
- packed_attention: stages/packing.py's packed forward against per-sequence forwards, and the sdpa kernels it runs;
- chunked_log_probs: stages/algorithms.py's chunked log-probs and entropy against the unchunked computation;
- zero3_sleep: stages/engine.py's ZeRO-3 engine with FusedAdam, its training states offloaded and reloaded between
  steps (--deepspeed_enable_sleep), against the same steps awake (needs DeepSpeed; skipped without it).
"""

from __future__ import annotations

import json
import os
import time
import zlib
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() "
                                                                       "is False here)")]

MIB = 2**20
GIB = 2**30


def record(name: str, results: dict) -> Path:
    """Write one check's results as JSON into the output folder."""
    folder = Path(os.environ.get("RLHF_GPU_TEST_OUTPUT", "test-output/gpu"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    environment = {"torch": torch.__version__, "cuda": torch.version.cuda,
                   "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    path.write_text(json.dumps({"environment": environment, **results}, indent=2, default=str))
    return path


# --------------------------------------------------------------------------------------------- (a) CUDA IPC buckets

# An 8B-like layout, scaled down: an embedding alone in its bucket (larger than one), then layers' matrices.
IPC_PARAMS = [("embed", (32_000, 4096))] + [(f"layer{i}.{name}", shape) for i in range(6)
                                            for name, shape in (("qkv", (6144, 4096)), ("mlp", (4096, 11008)))]
IPC_BUCKET_BYTES = 256 * MIB
IPC_SYNCS = 3


def _ipc_values(name: str, shape: tuple[int, ...], sync: int, device) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}/{sync}".encode()))  # the same in both processes
    return torch.randn(shape, generator=generator, device=device).to(torch.bfloat16)


def _ipc_engine(requests, replies) -> None:
    """The engine's side, in its own process: open each bucket, copy it into its own weights, compare them bitwise
    with the values regenerated from the seed, then acknowledge."""
    from stages.rl.weight_sync import open_shared

    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    weights = {name: torch.empty(shape, dtype=torch.bfloat16, device=device) for name, shape in IPC_PARAMS}
    while (message := requests.get()) is not None:
        sync, bucket, shared = message
        started = time.perf_counter()
        for name, tensor in open_shared(shared, bucket, device):
            weights[name].copy_(tensor)
        del tensor
        torch.cuda.synchronize()
        opened = time.perf_counter() - started
        equal = all(torch.equal(weights[name], _ipc_values(name, tuple(shape), sync, device))
                    for name, shape, _ in bucket)
        replies.put({"equal": equal, "seconds": opened, "allocated": torch.cuda.memory_allocated(device)})


def test_cuda_ipc_bucket_round_trip_between_two_processes():
    """Bitwise equal after each sync, the producer's memory back to its baseline once every bucket is released,
    and three syncs without growth on either side (stages/rl/weight_sync.py share_bucket / open_shared)."""
    import torch.multiprocessing as mp

    from stages.rl.weight_sync import location, plan_buckets, share_bucket

    device = torch.device("cuda:0")
    buckets = plan_buckets([(name, shape, torch.bfloat16) for name, shape in IPC_PARAMS], IPC_BUCKET_BYTES)
    context = mp.get_context("spawn")
    requests, replies = context.Queue(), context.Queue()
    engine = context.Process(target=_ipc_engine, args=(requests, replies), daemon=True)
    engine.start()
    results: dict = {"location": location(device), "buckets": len(buckets),
                     "bytes_per_sync": sum(torch.Size(s).numel() * 2 for _, s in IPC_PARAMS), "syncs": []}
    try:
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated(device)
        for sync in range(IPC_SYNCS):
            started, replies_of_sync = time.perf_counter(), []
            for bucket in buckets:
                tensors = [_ipc_values(name, tuple(shape), sync, device) for name, shape, _ in bucket]
                held, shared = share_bucket(tensors, device)
                del tensors
                requests.put((sync, bucket, [shared]))
                replies_of_sync.append(replies.get(timeout=120))
                held.release()
            torch.cuda.synchronize()
            torch.cuda.ipc_collect()
            results["syncs"].append({
                "seconds": time.perf_counter() - started,
                "equal": all(reply["equal"] for reply in replies_of_sync),
                "engine_open_seconds": sum(reply["seconds"] for reply in replies_of_sync),
                "engine_allocated": replies_of_sync[-1]["allocated"],
                "producer_above_baseline": torch.cuda.memory_allocated(device) - baseline})
    finally:
        requests.put(None)
        engine.join(timeout=60)
        record("ipc", results)
    syncs = results["syncs"]
    assert all(sync["equal"] for sync in syncs), syncs
    assert all(abs(sync["producer_above_baseline"]) <= 2 * MIB for sync in syncs), syncs
    assert len({sync["engine_allocated"] for sync in syncs}) == 1, syncs  # no growth on the engine's side
    assert engine.exitcode == 0


# ------------------------------------------------------------------------------------- (b) the plan against the GPU


def _llama(vocab: int, device, *, hidden=1024, intermediate=2816, layers=4, heads=8, kv_heads=4, max_len=8192,
           dtype=torch.bfloat16):
    """A LlamaForCausalLM of the tiny toolkit's architecture (stages/tiny.py build_tiny_model), sized up, untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_len, tie_word_embeddings=False, bos_token_id=None,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype), config


def _peak_above(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


# (vocabulary, hidden, MLP width, attention heads, key/value heads): Llama-3's vocabulary makes the logits the larger
# term; with 512 entries the recomputed layer is, at MLP widths of 2.75 to 4 times the hidden size; four layers of
# Llama-3-8B's own width.
PLAN_SHAPES = {"llama3-vocab": (128_256, 1024, 2816, 8, 4), "small-vocab": (512, 1024, 2816, 8, 4),
               "wide-mlp": (512, 1024, 4096, 8, 2), "wider-model": (512, 2048, 5632, 16, 8),
               "llama3-8b-layers": (128_256, 4096, 14_336, 32, 8),
               "llama3-8b-layers-small-vocab": (512, 4096, 14_336, 32, 8)}


@pytest.mark.parametrize("name", list(PLAN_SHAPES))
def test_plan_logits_and_checkpointed_activations_against_max_memory_allocated(name):
    """A forward + backward of 8192 packed tokens with gradient checkpointing, and a forward without gradients,
    against pipeline/memory.py's terms (trained_memory / frozen_memory at ZeRO-0: no gathering, no partitions),
    within 15%, on Llama shapes where the logits or the layer is the larger term."""
    from pipeline.memory import ModelShape, frozen_memory, trained_memory
    from stages import algorithms as algo

    vocab, hidden, intermediate, heads, kv_heads = PLAN_SHAPES[name]
    device = torch.device("cuda:0")
    model, config = _llama(vocab, device, hidden=hidden, intermediate=intermediate, heads=heads, kv_heads=kv_heads)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    shape = ModelShape.from_config(config.to_dict())
    tokens = 8192
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, tokens + 1), generator=generator).to(device)

    def train_step():
        logits = model(input_ids=ids[:, :-1], use_cache=False).logits
        algo.token_log_probs(logits, ids[:, 1:]).sum().backward()

    train_step()  # warm-up: kernels' workspaces, and the weights' gradients allocated once
    measured_train = _peak_above(train_step)
    model.zero_grad(set_to_none=False)  # gradients stay allocated: in the baseline, as the plan's states are

    def forward():
        with torch.no_grad():
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
            algo.token_log_probs(logits, ids[:, 1:])

    measured_forward = _peak_above(forward)
    plan_train = trained_memory("actor", shape, ranks=1, zero_stage=0, bf16=True, adam_offload=True, lora=False,
                                gradient_checkpointing=True, tokens=tokens, with_logits=True)
    plan_forward = frozen_memory("ref", shape, ranks=1, zero_stage=0, bf16=True, tokens=tokens, with_logits=True)
    results = {"shape": PLAN_SHAPES[name], "tokens": tokens, "params": shape.params,
               "train": {"measured_gib": measured_train / GIB, "plan_gib": plan_train.activations / GIB,
                         "plan_terms_gib": {"checkpoints": plan_train.checkpoints / GIB,
                                            "layer": plan_train.layer / GIB, "logits": plan_train.logits / GIB},
                         "measured_layer_values_per_token": (measured_train - plan_train.checkpoints) / tokens / 2,
                         "plan_layer_values_per_token": shape.layer_values(grad=True),
                         "ratio": measured_train / plan_train.activations},
               "forward": {"measured_gib": measured_forward / GIB, "plan_gib": plan_forward.activations / GIB,
                           "plan_terms_gib": {"layer": plan_forward.layer / GIB, "logits": plan_forward.logits / GIB},
                           "ratio": measured_forward / plan_forward.activations}}
    record(f"plan_memory_{name}", results)
    assert results["train"]["ratio"] == pytest.approx(1.0, abs=0.15), results
    assert results["forward"]["ratio"] == pytest.approx(1.0, abs=0.15), results


# ----------------------------------------------------------------------------------------- (c) packed attention


def _attention_kernels(fn) -> list[str]:
    """Names of the CUDA kernels `fn` launches that look like attention (flash, memory-efficient, or the math
    path's batched matmul + softmax)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    keys = ("flash", "fmha", "efficient_attention", "attention", "softmax")
    return sorted(name for name in names if any(key in name.lower() for key in keys))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_attention_matches_per_sequence_attention(dtype):
    """stages/packing.py: one padding-free row whose position ids restart at each sequence (transformers' sdpa path
    builds the block-causal mask from them) gives each sequence's log-probs of its own forward; and which sdpa
    kernels run, packed and per sequence. Also the block mask itself through F.scaled_dot_product_attention under
    each sdpa backend: which accept it."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from stages import packing

    device = torch.device("cuda:0")
    model, _ = _llama(4096, device, hidden=512, intermediate=1408, layers=2, heads=8, kv_heads=4, dtype=dtype)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [64, 300, 1024, 17, 2048, 511]
    sequences = [torch.randint(0, 4096, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        packed = packing.packed_log_probs(model, sequences)
        single = [packing.packed_log_probs(model, [seq])[0] for seq in sequences]
        packed_kernels = _attention_kernels(lambda: packing.packed_log_probs(model, sequences))
        single_kernels = _attention_kernels(lambda: packing.packed_log_probs(model, [sequences[0]]))
    diff = max(float((a - b).abs().max()) for a, b in zip(packed, single))

    # The block-causal mask by hand, as transformers builds it from the restarting position ids.
    _, position_ids, starts = packing.pack(sequences, device)
    segment = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
    positions = torch.arange(len(segment), device=device)
    mask = (segment[:, None] == segment[None, :]) & (positions[:, None] >= positions[None, :])
    q, k, v = (torch.randn(1, 8, len(segment), 64, device=device, dtype=dtype) for _ in range(3))
    reference = torch.cat([F.scaled_dot_product_attention(q[..., s:s + n, :], k[..., s:s + n, :], v[..., s:s + n, :],
                                                          is_causal=True) for s, n in zip(starts, lengths)], dim=2)
    backends = {}
    for backend in [getattr(SDPBackend, name) for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION",
                                                            "CUDNN_ATTENTION", "MATH") if hasattr(SDPBackend, name)]:
        try:
            with sdpa_kernel([backend]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            backends[backend.name] = {"accepted": True, "max_abs_diff": float((out - reference).abs().max())}
        except RuntimeError as error:
            backends[backend.name] = {"accepted": False, "error": str(error).splitlines()[0][:200]}
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    results = {"dtype": str(dtype), "lengths": lengths, "log_prob_max_abs_diff": diff,
               "packed_kernels": packed_kernels, "per_sequence_kernels": single_kernels, "mask_backends": backends}
    record(f"packed_attention_{str(dtype).removeprefix('torch.')}", results)
    assert diff <= (1e-3 if dtype == torch.float32 else 0.1), results  # log-probs of a 4096-entry vocabulary
    accepted = [name for name, result in backends.items() if result["accepted"]]
    assert accepted, results
    assert all(backends[name]["max_abs_diff"] <= tolerance for name in accepted), results


# ------------------------------------------------------------------------------------------ (d) chunked log-probs


def test_chunked_log_probs_and_entropy_on_gpu_match_the_unchunked_computation():
    """bf16 logits [2, 2048, 32000] on the GPU: chunked log-probs and entropy (128 positions a chunk) equal the
    float32 unchunked computation within 1e-4 (values of about 10) and one bf16 rounding (gradients); the chunked pass without
    gradients stays below an eighth of one float32 copy of the logits in peak allocated memory."""
    from stages import algorithms as algo

    device = torch.device("cuda:0")
    generator = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(2, 2048, 32_000, generator=generator, device=device) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 32_000, (2, 2048), generator=generator, device=device)
    results: dict = {"shape": list(logits.shape), "chunk": 128}
    for temperature in (1.0, 0.7):
        def unchunked_log_probs(x):
            scaled = x.float() / temperature
            return scaled.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)

        def unchunked_entropy(x):
            scaled = x.float() / temperature
            return torch.logsumexp(scaled, -1) - (torch.softmax(scaled, -1) * scaled).sum(-1)

        for name, chunked, unchunked in (
                ("log_probs", lambda x: algo.token_log_probs(x, labels, temperature, chunk=128), unchunked_log_probs),
                ("entropy", lambda x: algo.entropy_from_logits(x, temperature, chunk=128), unchunked_entropy)):
            leaf, reference_leaf = logits.clone().requires_grad_(), logits.clone().requires_grad_()
            weights = torch.randn(labels.shape, generator=generator, device=device)
            value, reference = chunked(leaf), unchunked(reference_leaf)
            (value * weights).sum().backward()
            (reference * weights).sum().backward()
            value_diff = float((value - reference).abs().max())
            grad_diff = float((leaf.grad.float() - reference_leaf.grad.float()).abs().max())
            grad_scale = float(reference_leaf.grad.float().abs().max())
            with torch.no_grad():
                peak = _peak_above(lambda: chunked(logits))
            results[f"{name}_t{temperature}"] = {"value_max_abs_diff": value_diff, "grad_max_abs_diff": grad_diff,
                                                 "grad_max_abs": grad_scale, "no_grad_peak_mib": peak / MIB,
                                                 "fp32_copy_mib": logits.numel() * 4 / MIB}
            del leaf, reference_leaf, value, reference
    record("chunked_log_probs", results)
    for key, result in results.items():
        if isinstance(result, dict):
            assert result["value_max_abs_diff"] <= 1e-4, (key, result)  # float32 sums over 32000 entries, ~10
            assert result["grad_max_abs_diff"] <= result["grad_max_abs"] * 2**-7, (key, result)
            assert result["no_grad_peak_mib"] < result["fp32_copy_mib"] / 8, (key, result)


# ------------------------------------------------------------------------------- (e) ZeRO-3 sleep with FusedAdam


def _zero3_losses(sleep_after: set[int], steps: int) -> tuple[list[float], dict]:
    """Train stages/engine.py's ZeRO-3 bf16 engine on one fixed batch for `steps` steps; after the steps in
    `sleep_after`, offload its training states as --deepspeed_enable_sleep does and reload them. Returns the losses
    and what the GPU held around the first sleep."""
    from types import SimpleNamespace

    from stages import engine as ds

    cfg = SimpleNamespace(zero_stage=3, bf16=True, max_norm=1.0, adam_offload=False, gradient_checkpointing=True,
                          lr_scheduler="constant", lr_warmup_ratio=0.0, adam_betas=(0.9, 0.95), l2=0.0)
    ds_config = ds.deepspeed_config(cfg, world_size=1, train_batch_size=4, micro_batch_size=4)
    model, _ = _llama(32_000, torch.device("cpu"), dtype=torch.bfloat16)
    model.train()
    engine = ds.build_train_engine(model, cfg, ds_config, learning_rate=1e-4, total_steps=steps)
    ids = torch.randint(0, 32_000, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
    memory: dict = {"optimizer": type(engine.optimizer.optimizer).__name__,
                    "params": sum(p.ds_numel for p in engine.module.parameters())}
    losses = []
    for step in range(steps):
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step in sleep_after:
            torch.cuda.synchronize()
            awake = torch.cuda.memory_allocated()
            started = time.perf_counter()
            ds.offload_training_states(engine)
            torch.cuda.synchronize()
            asleep, offload_s = torch.cuda.memory_allocated(), time.perf_counter() - started
            started = time.perf_counter()
            engine.reload_states()
            torch.cuda.synchronize()
            memory.setdefault("sleeps", []).append({
                "awake_gib": awake / GIB, "asleep_gib": asleep / GIB, "freed_gib": (awake - asleep) / GIB,
                "reloaded_gib": torch.cuda.memory_allocated() / GIB, "offload_s": offload_s,
                "reload_s": time.perf_counter() - started})
    if sleep_after:  # a checkpoint of the slept run: checksums recorded and checked over NCCL, then loaded
        import tempfile

        with tempfile.TemporaryDirectory() as ckpt:
            started = time.perf_counter()
            ds.save_checkpoint(engine, ckpt, steps, {"losses": losses})
            memory["checkpoint_save_s"] = time.perf_counter() - started
            started = time.perf_counter()
            memory["checkpoint_loaded"] = ds.load_checkpoint(engine, ckpt, steps)["losses"] == losses
            memory["checkpoint_load_s"] = time.perf_counter() - started
    engine.destroy()
    del engine, model
    torch.cuda.empty_cache()
    return losses, memory


def test_zero3_sleep_offloads_fused_adam_states_and_training_goes_on_unchanged():
    """stages/engine.py on one GPU under ZeRO-3 and bf16, as --deepspeed_enable_sleep runs it: DeepSpeed builds
    FusedAdam from optimizer_section (ZeRO-3's offload_states accepts no other), offload_training_states frees at least
    the fp32 master weights and Adam's two moments (12 bytes a parameter), reload_states brings them back, and the
    losses of a run that sleeps after every step equal those of one that never sleeps; its checkpoint's checksums are
    recorded and checked over NCCL before it loads. TORCH_CUDA_ARCH_LIST is left as the machine sets it
    (build_train_engine makes an arch-specific entry readable for DeepSpeed's JIT build)."""
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed here")
    import socket

    if not torch.distributed.is_initialized():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        deepspeed.init_distributed(dist_backend="nccl")
    steps = 4
    started = time.perf_counter()
    sleeping, memory = _zero3_losses(set(range(steps - 1)), steps)
    awake, _ = _zero3_losses(set(), steps)
    results = {"losses_sleeping": sleeping, "losses_awake": awake, **memory,
               "seconds_both_runs": time.perf_counter() - started}
    record("zero3_sleep", results)
    assert memory["optimizer"] == "FusedAdam", results
    first = memory["sleeps"][0]
    assert first["freed_gib"] * GIB >= 12 * memory["params"] * 0.95, results
    assert abs(first["reloaded_gib"] - first["awake_gib"]) <= 0.05 * first["awake_gib"], results
    assert sleeping[-1] < sleeping[0], results  # it learns the fixed batch
    assert sleeping == pytest.approx(awake, rel=1e-3), results
    assert memory["checkpoint_loaded"], results
