"""Ring attention (--ring_attn_size): a ring of ranks computes what one rank computes over the whole packed row.

The forwards are checked on two gloo ranks started here (log-probs, entropies, values, and gradients, with and
without gradient checkpointing, one and two key/value heads gathered at a time, a row whose tokens do not split
evenly). The stages are checked end to end: DPO and PPO (critic, reward model, reference: every model in a ring)
with rings of two ranks take the same steps as the same runs without a ring, to float rounding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from stage_runs import history_of, run_stage

from infra.ray_cluster import free_port
from stages.cli import parse_stage_args
from stages.registry import STAGES

TOLERANCE = 1e-5


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-3)


def _ring_rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """One rank of a ring of two: the ring's results against the whole row's, computed on this rank."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from stages import packing, ring_attention
    from stages.rl.actor import policy_forward
    from stages.sequences import build_sequences

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ring_attention.register()
    torch.manual_seed(0)
    # Ragged prompts and responses: 71 tokens, which two ranks split 36 + 35 (one padding token).
    lengths = [(9, 5), (14, 3), (6, 12), (11, 1), (4, 6)]
    prompts = [torch.randint(3, 200, (p,)).tolist() for p, _ in lengths]
    responses = [torch.randint(3, 200, (r,)).tolist() for _, r in lengths]
    micro = build_sequences(prompts, responses, 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ring_attention.RING_ATTENTION)
    value_model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1, attn_implementation=ring_attention.RING_ATTENTION)
    differences: dict[str, float] = {}
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for stride in (1, 2):
            ring = ring_attention.ring_of(rank, 2, 2, stride)
            results = {}
            for name, part in (("ring", ring), ("whole", None)):
                model.zero_grad()
                logp, entropy = policy_forward(model, micro, 0.7, True, with_entropy=True, ring=part)
                loss = (logp * micro["action_mask"]).sum() + 0.1 * (entropy * micro["action_mask"]).sum()
                loss.backward()
                grad = torch.cat([p.grad.flatten() for p in model.parameters()])
                if part is not None:  # each rank holds ring-size times its tokens' share: the mean is the gradient
                    dist.all_reduce(grad)
                    grad /= 2
                results[name] = (logp.detach(), entropy.detach(), grad)
            key = f"checkpointing={checkpointing} stride={stride}"
            for index, what in enumerate(("log-probs", "entropies", "gradient")):
                differences[f"{what} {key}"] = _largest_difference(results["ring"][index], results["whole"][index])
    sequences = [p + r for p, r in zip(prompts, responses)]
    with torch.no_grad():
        ring_values = packing.packed_values(value_model, sequences, ring_attention.ring_of(rank, 2, 2, 1))
        values = packing.packed_values(value_model, sequences)
    differences["values"] = max(_largest_difference(a, b) for a, b in zip(ring_values, values))
    if rank == 0:
        Path(out).write_text(json.dumps(differences))
    dist.destroy_process_group()


def test_a_ring_of_two_ranks_computes_the_whole_rows_log_probs_values_and_gradient(assets, tmp_path):
    out = tmp_path / "differences.json"
    mp.start_processes(_ring_rank, args=(free_port(), str(assets["model"]), str(out)), nprocs=2, start_method="spawn")
    differences = json.loads(out.read_text())
    assert len(differences) == 13
    assert all(difference <= TOLERANCE for difference in differences.values()), differences


def test_ring_attention_flags_are_checked_before_anything_runs():
    base = ["--config", "tiny", "--pretrain", "m", "--dataset", "d", "--num_gpus_per_node", "2"]
    with pytest.raises(SystemExit):
        parse_stage_args(STAGES["sft"], [*base, "--ring_attn_size", "2"])  # SFT needs --packing_samples, as in OpenRLHF
    with pytest.raises(SystemExit):
        parse_stage_args(STAGES["sft"], [*base, "--ring_attn_size", "3", "--packing_samples"])  # 3 does not divide 2 ranks
    with pytest.raises(SystemExit):
        parse_stage_args(STAGES["sft"], [*base, "--ring_head_stride", "2"])  # configures a ring that is off
    sft = parse_stage_args(STAGES["sft"], [*base, "--ring_attn_size", "2", "--packing_samples"])
    assert sft.ring_attn_size == 2 and any("ring attention" in note for note in sft.notes())
    # The RL stage turns packing on for a ring, as OpenRLHF's does, and says so.
    rl = parse_stage_args(STAGES["rl"], ["--config", "tiny", "--pretrain", "m", "--prompt_data", "p", "--ring_attn_size", "2",
                                 "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2",
                                 "--remote_rm_url", "stages/tiny_reward.py"])
    assert rl.packing_samples and "--ring_attn_size 2 turns --packing_samples on, as in OpenRLHF" in rl.notes()


def _same_steps(ring: list[dict], whole: list[dict], keys: tuple[str, ...]) -> None:
    assert len(ring) == len(whole) > 0
    for step, (a, b) in enumerate(zip(ring, whole), 1):
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), (step, key, a[key], b[key])


@pytest.mark.slow
def test_dpo_in_rings_takes_the_steps_of_one_rank(tmp_path, assets, sft_model):
    """Two ranks as one ring (policy and reference) against one rank (the preset's) without a ring."""
    runs = {}
    for ring in (1, 2):
        out = tmp_path / f"ring{ring}"
        run_stage("dpo", "--pretrain", sft_model, "--dataset", assets["pref_train"], "--packing_samples",
                  "--ring_attn_size", ring, "--num_gpus_per_node", ring, "--max_samples", 64, "--max_epochs", 1,
                  "--save_path", out / "model", "--ckpt_path", out / "ckpt")
        runs[ring] = history_of(out / "model")
    _same_steps(runs[2], runs[1], ("loss", "accuracy"))


@pytest.mark.slow
def test_ppo_in_rings_takes_the_steps_of_one_rank(tmp_path, assets, sft_model, reward_model):
    """PPO with a critic and the reward model: every model on two ranks in one ring against one rank each."""
    runs = {}
    for ring in (1, 2):
        out = tmp_path / f"ring{ring}"
        ranks = [flag for role in ("actor", "ref", "critic", "reward")
                 for flag in (f"--{role}_num_gpus_per_node", ring)]
        proc = run_stage("rl", "--pretrain", sft_model, "--reward_pretrain", reward_model, "--prompt_data",
                         assets["prompts_train"], "--advantage_estimator", "gae", "--no_use_kl_loss",
                         "--critic_learning_rate", "3e-4", "--packing_samples", "--ring_attn_size", ring, *ranks,
                         "--max_samples", 64, "--save_path", out / "model", "--ckpt_path", out / "ckpt")
        runs[ring] = history_of(out / "model")
    assert "ring attention" in proc.stdout
    _same_steps(runs[2], runs[1], ("reward", "policy_loss", "critic_loss", "kl"))
