"""Pieces of the RL stage that need no Ray: the prompt stream, drift guards, placement plans, reward statistics,
weight-sync buckets and the CPU rehearsal of a GPU preset."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import datasets
import pytest
import torch

from pipeline.rehearsal import StandIns, rehearse_stage
from stages.cli import parse_stage_args
from stages.placement import models_take_turns, placement_plan, rank_processes
from stages.prepared import ExampleRows
from stages.registry import STAGES
from stages.rl.config import RLConfig
from stages.rl.driver import (
    PromptStream, RewardUnavailableError, drift_warnings, evaluate_held_out, logprob_gap_warning,
)
from stages.rl.sync_check import WeightSyncError
from stages.rl.critic import ending_with_eos, reward_normalization
from stages.rl.rollout_queue import RolloutQueue
from stages.rl.weight_sync import SharedBucket, bucket_bytes_total, open_shared, plan_buckets, share_bucket
from stages.tiny import build_tiny_datasets

TINY = ["--config", "tiny"]


def rl_config(*flags: str):
    return parse_stage_args(STAGES["rl"], [*TINY, *flags], require_inputs=False)


class EnginesLog:
    """What a rollout queue asks of the engines, and a check that a weight update never overlaps generation."""

    def __init__(self, fail_at: int | None = None):
        self.lock = threading.Lock()
        self.produced: list[tuple[int, int]] = []  # (step, policy version)
        self.syncs = 0
        self.fail_at = fail_at

    def produce(self, step: int, version: int):
        assert self.lock.acquire(blocking=False), "generation overlaps a weight update"
        try:
            time.sleep(0.01)
            if step == self.fail_at:
                raise RuntimeError(f"engine died at step {step}")
            self.produced.append((step, version))
            return None if step == 7 else f"rollout {step}"
        finally:
            self.lock.release()

    def sync(self):
        assert self.lock.acquire(blocking=False), "a weight update overlaps generation"
        time.sleep(0.01)
        self.syncs += 1
        self.lock.release()


def rollouts(produce, first: int, last: int, queue_size: int, ready: list | None = None):
    """What the driver uses: rollouts on demand for synchronous training (queue 0), else the async queue."""
    from stages.rl.driver import RolloutsOnDemand

    if queue_size == 0:
        assert not ready
        return RolloutsOnDemand(produce, first)
    return RolloutQueue(produce, first=first, last=last, queue_size=queue_size, ready=ready).start()


@pytest.mark.parametrize("queue_size", [0, 1, 2])
def test_the_rollout_of_step_k_comes_from_the_policy_of_step_k_minus_the_queue_size(queue_size):
    engines = EnginesLog()
    queue = rollouts(engines.produce, 0, 6, queue_size)
    for step in range(6):
        assert queue.take(step) == f"rollout {step}"
        queue.update_weights(engines.sync if step != 2 else None)  # step 3's actor frozen: no sync, a new version
        if step == 3:  # a checkpoint now keeps the rollouts produced for the next steps
            assert queue.pending(4) == [f"rollout {s}" for s in range(4, 4 + queue_size)]
    queue.close()
    assert engines.produced == [(step, max(step - queue_size, 0)) for step in range(6)]
    assert engines.syncs == 5
    # Resumed from that checkpoint: the kept rollouts first, then production at the checkpoint's version.
    resumed_engines = EnginesLog()
    resumed = rollouts(resumed_engines.produce, 4, 8, queue_size, [f"rollout {s}" for s in range(4, 4 + queue_size)])
    taken = []
    for step in range(4, 8):
        taken.append(resumed.take(step))
        if taken[-1] is None:
            break
        resumed.update_weights(resumed_engines.sync)
    assert taken == ["rollout 4", "rollout 5", "rollout 6", None]
    assert resumed_engines.produced == [(step, max(step - queue_size, 4)) for step in range(4 + queue_size, 8)]


def test_a_failed_rollout_reaches_the_trainer():
    queue = RolloutQueue(EnginesLog(fail_at=2).produce, first=0, last=6, queue_size=2).start()
    assert queue.take(0) == "rollout 0"
    with pytest.raises(RuntimeError, match="engine died at step 2"):
        queue.update_weights(None)  # waits for step 2, the last rollout due from version 0
    assert queue.take(1) == "rollout 1"  # produced before the failure
    with pytest.raises(RuntimeError, match="engine died at step 2"):
        queue.take(2)


def test_a_stuck_producer_fails_the_trainer_after_the_stall_timeout_instead_of_holding_it_forever():
    from stages.rl.rollout_queue import STALL_TIMEOUT_S, RolloutStalled

    hung = threading.Event()

    def produce(step: int, version: int) -> str:
        if step == 1:
            hung.wait()  # an engine that never answers
        return f"rollout {step}"

    queue = RolloutQueue(produce, first=0, last=4, queue_size=2, stall_timeout_s=0.3).start()
    assert queue.take(0) == "rollout 0"
    started = time.monotonic()
    with pytest.raises(RolloutStalled, match="no rollout produced for 0.3 s while waiting for the rollout of step 1"):
        queue.take(1)
    with pytest.raises(RolloutStalled, match="step 2, the last rollout due from policy version 0"):
        queue.update_weights(None)
    assert time.monotonic() - started < 5 and STALL_TIMEOUT_S == 3600
    hung.set()


def test_with_partial_rollout_a_weight_update_lands_between_two_segments_of_a_response():
    first_segment_done, synced = threading.Event(), threading.Event()

    def produce(step: int, version: int) -> list[int]:
        versions = []
        for segment in range(3):
            versions.append(queue.segment(lambda: time.sleep(0.01))[1])
            if step == 1 and segment == 0:
                first_segment_done.set()
                assert synced.wait(10)
        return versions

    queue = RolloutQueue(produce, first=0, last=2, queue_size=1, partial=True)
    queue.start()
    assert queue.take(0) == [0, 0, 0]
    assert first_segment_done.wait(10)  # step 1's rollout is being generated: the update does not wait for it
    queue.update_weights(synced.set)
    assert queue.take(1) == [0, 1, 1]  # its first segment from version 0, the rest from version 1


def test_prompt_stream_walks_seeded_episodes_and_resumes_at_its_position():
    prompts = ExampleRows(datasets.Dataset.from_list([{"prompt": str(i)} for i in range(10)]))
    stream = PromptStream(prompts, seed=3, num_episodes=2)
    first = [p["prompt"] for p in stream.take(4)] + [p["prompt"] for p in stream.take(8)]
    assert sorted(first[:10]) == sorted(str(i) for i in range(10))  # one episode holds every prompt once
    assert stream.position == 12
    resumed = PromptStream(prompts, seed=3, num_episodes=2, position=12)
    rest = [p["prompt"] for p in stream.take(100)]
    assert [p["prompt"] for p in resumed.take(100)] == rest and len(rest) == 8  # then the stream ends
    assert stream.take(1) == []
    assert PromptStream(prompts, seed=4, num_episodes=1).take(10) != PromptStream(prompts, 3, 1).take(10)


class EndpointsDown:
    """A scorer whose every reward request failed (the endpoints are down), answering the engines' samples."""

    def sample(self, cfg, engines, prompts, n, **sampling):
        from stages.rewards import RewardBatch
        from stages.rl.rollout import Rollout

        rollouts = [Rollout(i // n, p["prompt"], [5, 2], "x", None, "stop", [1]) for i, p in enumerate(prompts * n)]
        nan = torch.full((len(rollouts),), float("nan"))
        failed = RewardBatch(nan, nan.clone(), torch.ones(len(rollouts), dtype=torch.bool), {}, ["r:1: refused"])
        return rollouts, failed


def test_held_out_rewards_that_all_failed_are_an_error_to_retry_never_a_nan_metric():
    cfg = RLConfig(eval_n_samples_per_prompt=0)
    with pytest.raises(RewardUnavailableError, match="no held-out prompt got a reward: r:1: refused"):
        evaluate_held_out(cfg, types.SimpleNamespace(engines=[]), [{"prompt": "1+1", "label": "2"}], EndpointsDown())


def test_drift_guards_name_what_drifts():
    cfg = rl_config("--drift_max_kl", "5", "--drift_max_truncated_fraction", "0.5", "--drift_length_ratio", "2")
    first = {"kl": 0.0, "truncated_fraction": 0.0, "response_length": 10.0}
    assert drift_warnings(cfg, first, {"kl": 1.0, "truncated_fraction": 0.1, "response_length": 12.0}) == {}
    warnings = drift_warnings(cfg, first, {"kl": 6.0, "truncated_fraction": 0.9, "response_length": 25.0})
    assert set(warnings) == {"kl", "truncation", "length"}
    assert "6.00 > 5" in warnings["kl"] and "90%" in warnings["truncation"] and "10.0 -> 25.0" in warnings["length"]
    assert set(drift_warnings(cfg, first, {"kl": 0.0, "truncated_fraction": 0.0, "response_length": 4.0})) == {"length"}


def test_the_log_prob_gap_warns_then_stops_the_stage_but_not_on_samples_of_an_older_policy():
    cfg = rl_config("--logprob_gap_warn", "0.1", "--logprob_gap_stop", "1.0")
    record = {"logprob_gap_mean": 0.05, "logprob_gap_max": 0.4, "logprob_gap_k3": 0.002}
    assert logprob_gap_warning(cfg, record, step=3, lag=0) is None
    warning = logprob_gap_warning(cfg, {**record, "logprob_gap_mean": 0.3}, step=3, lag=0)
    assert "differ from the actor's by 0.3000 nats per token" in warning and "--logprob_gap_warn 0.1" in warning
    with pytest.raises(WeightSyncError, match=r"step 3: .* above --logprob_gap_stop 1: the engines do not sample"):
        logprob_gap_warning(cfg, {**record, "logprob_gap_mean": 4.2}, step=3, lag=0)
    # --async_train: the samples' policy moved since; its change is in the gap too.
    assert "(samples 2 policy version(s) old)" in logprob_gap_warning(cfg, {**record, "logprob_gap_mean": 4.2}, 3, 2)
    assert logprob_gap_warning(rl_config("--logprob_gap_stop", "none"), {**record, "logprob_gap_mean": 4.2}, 3, 0)


@pytest.mark.parametrize(
    "flags, plan",
    [
        (["--no_colocate_all_models"], {"actor": ["actor"], "ref": ["ref"], "reward": ["reward"],
                                        "engines": ["engines"]}),
        (["--no_colocate_all_models", "--colocate_actor_ref", "--advantage_estimator", "gae",
          "--colocate_critic_reward"],
         {"actor": ["actor", "ref"], "critic": ["critic", "reward"], "engines": ["engines"]}),
        (["--advantage_estimator", "gae"], {"shared": ["actor", "critic", "ref", "reward", "engines"]}),
        (["--remote_rm_url", "r.py", "--init_kl_coef", "0", "--kl_estimator", "k1", "--no_use_kl_loss"],
         {"shared": ["actor", "engines"]}),
    ],
)
def test_placement_plans_follow_the_colocation_flags(flags, plan):
    assert placement_plan(rl_config(*flags)) == plan


def test_colocated_models_of_equal_ranks_share_their_rank_processes():
    """One process per rank holds the models that share a placement group; with --async_train (rollouts scored on
    another thread) each model gets processes of its own."""
    shared = ["actor", "critic", "ref", "reward"]
    assert rank_processes(rl_config("--advantage_estimator", "gae"), shared) == [shared]
    assert rank_processes(rl_config("--no_colocate_all_models"), ["reward"]) == [["reward"]]
    asynchronous = rl_config("--no_colocate_all_models", "--colocate_actor_ref", "--async_train")
    assert rank_processes(asynchronous, ["actor", "ref"]) == [["actor"], ["ref"]]


def test_models_on_shared_gpus_take_turns():
    """Colocated on GPUs, the experience forwards and the updates run one model at a time (as in OpenRLHF): side
    by side, every model's activations would have to fit at once. Apart, each model has GPUs of its own."""
    assert models_take_turns(rl_config(), "cuda")  # the tiny preset colocates, as the seed's commands do
    assert not models_take_turns(rl_config("--no_colocate_all_models"), "cuda")
    assert models_take_turns(rl_config("--no_colocate_all_models"), "cpu")  # one set of cores for all


def test_reward_statistics_are_read_in_ours_and_openrlhfs_names():
    assert reward_normalization(types.SimpleNamespace(reward_mean=1.5, reward_std=2.0)) == (1.5, 2.0)
    assert reward_normalization(types.SimpleNamespace(mean=-0.5, std=0.0)) == (-0.5, 1e-8)
    assert reward_normalization(types.SimpleNamespace()) is None


def test_weight_sync_buckets_keep_order_dtype_and_size():
    params = [("a", (4, 4), torch.float32), ("b", (1000,), torch.float32), ("c", (2,), torch.bfloat16),
              ("d", (10,), torch.bfloat16), ("e", (300,), torch.float32)]
    buckets = plan_buckets(params, bucket_bytes=1024)
    assert [[name for name, _, _ in bucket] for bucket in buckets] == [["a"], ["b"], ["c", "d"], ["e"]]
    assert bucket_bytes_total(buckets) == (16 + 1000 + 300) * 4 + 12 * 2


def test_a_shared_bucket_opens_as_the_same_weights_and_its_segment_goes_with_its_release():
    """Colocated engines' sync on CPU: the actor rank's bucket in a shared-memory segment, opened by name; the rank
    removes the segment when the engines are done, so a sync leaves nothing behind in /dev/shm."""
    tensors = [torch.arange(6.0).view(2, 3), torch.full((4,), 0.5)]
    bucket = [("a", (2, 3), "float32"), ("b", (4,), "float32")]
    held, shared = share_bucket(tensors, torch.device("cpu"))
    # Opened by another process, as an engine does (one of this process would share its resource tracker).
    opener = ("import pickle, sys, torch; from stages.rl.weight_sync import open_shared; "
              "shared, bucket = pickle.loads(sys.stdin.buffer.read()); "
              "print({name: t.tolist() for name, t in open_shared([shared], bucket, torch.device('cpu'))})")
    proc = subprocess.run([sys.executable, "-c", opener], input=pickle.dumps((shared, bucket)), capture_output=True,
                          cwd=Path(__file__).parents[1], check=True)
    assert proc.stdout.decode().strip() == str({"a": tensors[0].tolist(), "b": tensors[1].tolist()})
    assert proc.stderr == b""
    segment = Path("/dev/shm") / shared.handle[0]
    assert segment.exists()
    held.release()
    assert not segment.exists()
    with pytest.raises(RuntimeError, match="no actor rank shares weights on host .* the engines must be colocated"):
        list(open_shared([SharedBucket("gpu 0000", None)], bucket, torch.device("cpu")))


def test_llama3_8b_rl_rehearsal_keeps_the_preset_but_for_stated_swaps(tmp_path):
    preset = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b"], require_inputs=False).model_dump(mode="json")
    data = build_tiny_datasets(tmp_path / "data")
    stand_ins = StandIns("base", "sft", "rm", data["prompts_train"].parent, tmp_path / "fixtures")
    values, swaps = rehearse_stage("rl", preset, stand_ins)
    by_field = {swap.field: swap for swap in swaps}
    assert by_field["device"].after == "cpu"
    assert by_field["actor_num_gpus_per_node"].after == 2 and by_field["vllm_tensor_parallel_size"].after == 1
    assert (values["pretrain"], values["reward_pretrain"]) == ("sft", "rm")  # the policy and scorer stand-ins
    # Same ratios: 2 micro-batches per rank and step, 8 optimizer steps per rollout.
    assert values["train_batch_size"] == values["micro_train_batch_size"] * 2 * 2
    assert values["rollout_batch_size"] * values["n_samples_per_prompt"] == 8 * values["train_batch_size"]
    for kept in ("advantage_estimator", "colocate_all_models", "zero_stage", "bf16", "vllm_enable_sleep",
                 "deepspeed_enable_sleep", "vllm_sync_backend", "normalize_reward", "init_kl_coef",
                 "actor_learning_rate"):
        assert kept not in by_field and values[kept] == preset[kept]
    first_prompt = json.loads(data["prompts_train"].read_text().splitlines()[0])["prompt"]
    fixture = Path(values["prompt_data"]).read_text()
    assert f'"context_messages": [{{"role": "user", "content": "{first_prompt}"}}]' in fixture.splitlines()[0]
    RLConfig.model_validate(values)  # the rehearsal is a valid config
    # Rings of 4 of the 8 GPUs (2 data-parallel ranks, 8 micro-batches each per step): one ring of the 2 CPU ranks,
    # one data-parallel rank with the same 8 micro-batches per step.
    ring = {**preset, "ring_attn_size": 4, "packing_samples": True}
    values, swaps = rehearse_stage("rl", ring, stand_ins)
    assert {swap.field: swap.after for swap in swaps}["ring_attn_size"] == 2
    assert values["train_batch_size"] == values["micro_train_batch_size"] * 1 * 8
    RLConfig.model_validate(values)


def test_rl_stops_on_what_the_supervised_stages_stop_on_and_its_own_losses(tmp_path):
    from stages.engine import NonFiniteLossError, commit_checkpoint, stop_if_diverged
    from stages.rl.driver import DIVERGENCE_KEYS

    assert {"policy_loss", "critic_loss", "kl", "grad_norm", "critic_grad_norm"} <= set(DIVERGENCE_KEYS)
    stop_if_diverged({"policy_loss": 0.1, "kl": 0.0, "grad_norm": 3.0}, 5, DIVERGENCE_KEYS, str(tmp_path))
    commit_checkpoint(tmp_path, 5, max_keep=2)
    with pytest.raises(NonFiniteLossError, match=r"step 7: grad_norm=nan is not finite.*step 5, is kept"):
        stop_if_diverged({"policy_loss": 0.1, "grad_norm": float("nan")}, 7, DIVERGENCE_KEYS, str(tmp_path))


def test_a_truncated_response_is_scored_at_an_eos_as_the_reward_model_was_trained():
    assert ending_with_eos([5, 6, 2], eos_token_id=2) == [5, 6, 2]  # stopped: scored as it is
    assert ending_with_eos([5, 6, 7], eos_token_id=2) == [5, 6, 7, 2]  # cut at the length limit: eos appended
    assert ending_with_eos([5, 6, 7], eos_token_id=2, max_positions=3) == [5, 6, 2]  # no position left: replaced


def _deepspeed_choice(ds_config: dict):
    """The optimizer class DeepSpeed builds from `ds_config`'s "optimizer" section, by its own selection
    (DeepSpeedEngine.get_optimizer_configuration) on a stand-in engine: no GPU, no engine needed."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    offload = ds_config["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu"
    stand_in = types.SimpleNamespace(zero_use_cpu_optimizer=lambda: offload, bf16_optimizer_states=lambda: False,
                                     zenflow=False)
    params = dict(ds_config["optimizer"]["params"])
    optimizer_cls, kwargs = DeepSpeedEngine.get_optimizer_configuration(stand_in, params, True)
    return optimizer_cls, kwargs


@pytest.mark.parametrize("adam_offload", [False, True])
def test_on_gpus_deepspeed_builds_the_optimizer_from_its_config_fused_adam_that_zero3_can_offload(adam_offload):
    """The seed's hybrid PPO command (ZeRO-3, --deepspeed_enable_sleep) on GPUs: the DeepSpeed config carries an
    AdamW section, from which DeepSpeed builds FusedAdam, the class ZeRO-3's offload_states asserts
    (deepspeed/runtime/zero/stage3.py: "Offloading is supported only for DeepSpeed FusedAdam."); with --adam_offload
    DeepSpeedCPUAdam in AdamW mode, as the instance built before. On CPU: no section (torch's AdamW instance)."""
    import deepspeed.ops.adam.fused_adam

    from stages import engine as ds

    # --adam_offload goes without --deepspeed_enable_sleep under ZeRO-3 (refused together: tests/test_config.py).
    argv = ["--config", "tiny", "--colocate_all_models", "--zero_stage", "3", "--adam_betas", "0.9", "0.95", "--l2",
            "0.01", "--pretrain", "m", "--prompt_data", "p.jsonl", "--remote_rm_url", "r.py",
            *(["--adam_offload"] if adam_offload else ["--deepspeed_enable_sleep"])]
    cfg = parse_stage_args(STAGES["rl"], argv)
    section = ds.optimizer_section(cfg, learning_rate=5e-7, device="cuda")
    assert section == {"type": "AdamW", "params": {"lr": 5e-7, "betas": [0.9, 0.95], "eps": 1e-8,
                                                   "weight_decay": 0.01}}
    ds_config = {**ds.deepspeed_config(cfg, world_size=8, train_batch_size=cfg.train_batch_size,
                                       micro_batch_size=cfg.micro_train_batch_size), "optimizer": section}
    optimizer_cls, kwargs = _deepspeed_choice(ds_config)
    if adam_offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        assert optimizer_cls is DeepSpeedCPUAdam and kwargs["adamw_mode"] is True
    else:
        assert optimizer_cls is deepspeed.ops.adam.fused_adam.FusedAdam and kwargs == {"adam_w_mode": True}
    assert ds.optimizer_section(cfg, learning_rate=5e-7, device="cpu") is None


def test_an_arch_specific_cuda_arch_list_is_read_as_deepspeeds_jit_build_can(monkeypatch):
    """DeepSpeed's JIT build of FusedAdam fails on `9.0a` (an H200's CUDA image sets it): the suffix is dropped,
    `+PTX` and the other entries kept; a list it reads already is left alone (None)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builder, on any machine

    from stages.engine import jit_arch_list

    assert jit_arch_list("9.0a") == "9.0"
    assert jit_arch_list("8.0;9.0a+PTX") == "8.0;9.0+PTX"
    assert jit_arch_list("8.0 9.0a 10.0f") == "8.0;9.0;10.0"
    for readable in ("9.0", "8.0;9.0+PTX", "7.5 8.0", ""):
        assert jit_arch_list(readable) is None
    # DeepSpeed's own JIT build arguments of FusedAdam: refused with the suffix, read without it.
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="'0a'"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", jit_arch_list("8.0;9.0a"))
    builder.compute_capability_args()


def test_deepspeed_sleep_offloads_the_trained_models_once_built_on_gpus_only():
    from stages.rl.driver import offload_trained_states

    calls = []

    class Group:
        def __init__(self, name):
            self.name = name

        def run(self, method, *args):
            calls.append((self.name, method))

    roles = types.SimpleNamespace(get={"actor": Group("actor"), "critic": Group("critic"), "ref": Group("ref")}.get)
    cfg = types.SimpleNamespace(deepspeed_enable_sleep=True)
    assert offload_trained_states(cfg, roles, gpu=True) == ["critic", "actor"]
    assert calls == [("critic", "offload_states"), ("actor", "offload_states")]
    calls.clear()
    assert offload_trained_states(cfg, roles, gpu=False) == [] and calls == []
    assert offload_trained_states(types.SimpleNamespace(deepspeed_enable_sleep=False), roles, gpu=True) == []


def test_a_tensor_parallel_engine_sees_the_gpus_whatever_ray_sets_for_a_zero_gpu_actor():
    """A TP-2 engine of the seed's hybrid command (engine 1: bundles 2 and 3, workers of 0.2 GPU): the actor asks
    Ray not to blank CUDA_VISIBLE_DEVICES for a zero-GPU actor, and where Ray did (its pre-2.60 default, or
    RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 on the cluster) the engine drops the empty value before vLLM starts."""
    from stages.rl.rollout import engine_device_env, tp_engine_env

    assert tp_engine_env([2, 3], 0.2) == {"VLLM_RAY_BUNDLE_INDICES": "2,3", "VLLM_RAY_PER_WORKER_GPUS": "0.2",
                                          "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    assert engine_device_env({"CUDA_VISIBLE_DEVICES": ""}, 2) == {"CUDA_VISIBLE_DEVICES": None}
    assert engine_device_env({}, 2) == {}  # Ray 2.60's default: the variable is not set, all GPUs visible
    assert engine_device_env({"CUDA_VISIBLE_DEVICES": "0,1"}, 2) == {}
    # A TP-1 engine holds its own GPU share: Ray's ids for it are right, an empty value means no GPU at all.
    assert engine_device_env({"CUDA_VISIBLE_DEVICES": ""}, 1) == {}


def test_engines_start_and_sleep_before_the_models_load_on_shared_gpus():
    """The seed's hybrid engine (--colocate_all_models --vllm_enable_sleep): vLLM profiles the GPUs before any model
    loads there, then sleeps; elsewhere engines and models start at once."""
    from stages.placement import startup_order

    seed = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b"], require_inputs=False)
    assert seed.colocate_all_models and seed.vllm_enable_sleep
    assert startup_order(seed, "cuda") == ("engines", "engines asleep", "models")
    assert startup_order(seed, "cpu") == ("engines and models",)  # CPU engines keep their memory
    awake = seed.model_copy(update={"vllm_enable_sleep": False})
    assert startup_order(awake, "cuda") == ("engines and models",)
    assert startup_order(rl_config(), "cpu") == ("engines and models",)


def test_work_is_split_over_the_engines_in_consecutive_near_equal_parts():
    from stages.rl.rollout import engine_parts

    def spans(count, engines):
        return [(i, engine, part.start, min(part.stop, count)) for i, engine, part in engine_parts(engines, count)]

    assert spans(5, ["a", "b"]) == [(0, "a", 0, 3), (1, "b", 3, 5)]
    assert spans(4, ["a", "b"]) == [(0, "a", 0, 2), (1, "b", 2, 4)]
    assert spans(1, ["a", "b", "c"]) == [(0, "a", 0, 1)]  # fewer items than engines: the others get none
    assert spans(0, ["a", "b"]) == []


def test_a_sync_that_left_a_tensor_unloaded_stops_before_anything_is_probed():
    """The engine's receipt of a sync (what was announced and never loaded, or loaded unannounced) is read before
    the read-back or the probe: the engine holds a mix of old and new weights, named with the first five."""
    from stages.rl.sync_check import SyncCheck

    check = SyncCheck(types.SimpleNamespace(rollout_dtype="float32", weight_sync_check_interval=4), roles=None,
                      probe=None, pad_token_id=0)
    missing = [f"model.layers.{i}.self_attn.k_proj.weight" for i in range(7)]
    with pytest.raises(WeightSyncError, match=r"^weight sync 3: engine 1 never loaded model.layers.0.self_attn.k_proj"
                                              r".weight, .*model.layers.4.self_attn.k_proj.weight \(and 2 more\); "
                                              r"loaded unannounced lm_head.weight: the engine holds a mix of old and "
                                              r"new weights$"):
        check.after_sync(3, [{"missing": [], "unexpected": []}, {"missing": missing, "unexpected": ["lm_head.weight"]}])
    assert check.after_sync(3, [{"missing": [], "unexpected": []}]) == {}  # not due: every 4th, and the first
    assert check.checks == 0
