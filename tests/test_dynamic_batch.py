"""--use_dynamic_batch: micro-batches by token budget (OpenRLHF's meaning), with worked numbers for how sequences
are counted and balanced, the micro-batch count agreed by every rank of a model, and the actor's and critic's
optimizer step on a real DeepSpeed engine (one gloo rank, ZeRO-2, the tiny model): the same losses and weights as
with fixed micro-batches, since every loss is a token sum over the whole step (stages/algorithms.py), however the
step is split. Tolerance: 1e-5 relative for losses, gradient norms and log-probs (the float rounding of other batch
shapes); a tenth of the learning rate for weights after the Adam step (Adam's first step divides each gradient by its
own size, which turns the rounding of a near-zero gradient into a visible part of a step)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_workers import built, ragged_shard

from stages.cli import parse_stage_args
from stages.registry import STAGES
from stages.rl.actor import PolicyWorker, rank_micro_batches, sequence_log_probs
from stages.rl.critic import CriticWorker
from stages.sequences import balanced_partitions, build_sequences, first_fit_count, select_rows


def test_first_fit_counts_the_micro_batches_of_a_token_budget():
    # budget 8: [7] [5] -> 4 fits neither, [4]; 3 joins 5 (8); 1 joins 7 (8): three micro-batches.
    assert first_fit_count([7, 5, 4, 3, 1], 8) == 3
    assert first_fit_count([9, 2], 8) == 2  # a sequence over the budget gets a micro-batch of its own
    assert first_fit_count([2, 2, 2, 2], 8) == 1 and first_fit_count([], 8) == 0


def test_balanced_partitions_put_the_longest_first_into_the_lightest_group():
    # 7 -> g0, 5 -> g1, 4 -> g2, 3 -> g2 (4 is lightest), 1 -> g1 (5): token sums 7, 6, 7.
    assert balanced_partitions([7, 5, 4, 3, 1], 3) == [[0], [1, 4], [2, 3]]
    assert balanced_partitions([3, 3], 3) == [[0], [1], []]  # fewer sequences than groups: one stays empty


def test_selected_rows_are_cut_to_their_longest_sequence():
    batch = build_sequences([[5, 6], [5, 6, 7, 8], [5]], [[9], [9, 9], [9, 9, 9]], pad_id=0)
    batch["advantages"] = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)  # next-token columns (T - 1 = 5)
    part = select_rows(batch, [0, 2], "cpu")
    assert part["input_ids"].tolist() == [[5, 6, 9, 0], [5, 9, 9, 9]]  # width 4: the longer of the two
    assert part["action_mask"].tolist() == [[0, 1, 0], [1, 1, 1]] and part["advantages"].shape == (2, 3)
    assert part["advantages"].tolist() == [batch["advantages"][0, :3].tolist(), batch["advantages"][2, :3].tolist()]


def _count_over_two_ranks(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    # Rank 0: one short sequence (one micro-batch of 16 tokens); rank 1: two long ones (two micro-batches).
    lengths = [[4], [12, 12]][rank]
    batch = build_sequences([[1] * (n - 1) for n in lengths], [[2]] * len(lengths), pad_id=0)
    micro = rank_micro_batches(batch, size=1, token_budget=16, device="cpu")
    results[rank] = [(rows, int(part["action_mask"].sum())) for part, rows in micro]
    dist.destroy_process_group()


def test_every_rank_of_a_model_runs_as_many_micro_batches_as_the_one_needing_most(tmp_path):
    """ZeRO-3 gathers parameters in every forward, all ranks at once: a rank that needs fewer micro-batches runs a
    micro-batch without action tokens (its first sequence, rows []) so that the counts agree."""
    results = mp.Manager().dict()
    mp.spawn(_count_over_two_ranks, args=(str(tmp_path / "store"), results), nprocs=2)
    assert results[1] == [([0], 1), ([1], 1)]
    assert results[0] == [([0], 1), ([], 0)]


def forwards_of(worker) -> list[int]:
    """The real tokens of each forward of `worker`'s model, recorded as they run."""
    seen: list[int] = []
    module = worker.engine.module

    def record(_module, args, kwargs):
        mask = kwargs.get("attention_mask")
        seen.append(int(mask.sum()) if mask is not None else kwargs["input_ids"].numel())

    module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


@pytest.mark.parametrize("packing", [False, True])
def test_an_optimizer_step_by_token_budget_is_the_step_by_fixed_micro_batches(sft_model, one_deepspeed_rank,
                                                                              packing):
    # One optimizer step of the 8 sequences: 4 micro-batches of 2 when fixed.
    flags = ["--config", "tiny", "--pretrain", str(sft_model), "--advantage_estimator", "gae", "--prompt_data", "p.jsonl",
             "--train_batch_size", "8", "--rollout_batch_size", "2", "--n_samples_per_prompt", "4",
             "--micro_rollout_batch_size", "2",
             "--remote_rm_url", "stages/tiny_reward.py", "--entropy_loss_coef", "0.01"]
    flags += ["--packing_samples"] if packing else []
    fixed_cfg = parse_stage_args(STAGES["rl"], [*flags, "--micro_train_batch_size", "2"])
    dynamic_cfg = parse_stage_args(STAGES["rl"], [*flags, "--use_dynamic_batch", "--train_max_tokens_per_gpu", "30",
                                          "--rollout_max_tokens_per_gpu", "45"])
    shard = ragged_shard()
    lengths = shard["attention_mask"].sum(dim=1).tolist()
    step = dict(step_tokens=float(shard["action_mask"].sum()))
    results = {}
    initial = None
    for name, cfg in (("fixed", fixed_cfg), ("dynamic", dynamic_cfg)):
        actor, critic = built(PolicyWorker, cfg), built(CriticWorker, cfg)
        initial = initial or {k: v.detach().clone() for k, v in actor.engine.module.named_parameters()}
        seen = forwards_of(actor)
        logp = actor.log_probs(shard)
        forwards_for_logp = list(seen)
        actor_totals = actor.train_step(shard, step_sequences=8, kl_coef=0.01, **step)
        critic_totals = critic.train_step(shard, **step)
        # Before clipping: the whole step's gradient, which Adam's first update would hide the scale of.
        actor_totals["grad_norm"] = float(actor.engine.get_global_grad_norm())
        critic_totals["grad_norm"] = float(critic.engine.get_global_grad_norm())
        results[name] = dict(logp=logp, actor=actor_totals, critic=critic_totals, forwards=forwards_for_logp,
                             train_forwards=seen[len(forwards_for_logp):],
                             actor_weights={k: v.detach().clone() for k, v in actor.engine.module.named_parameters()},
                             critic_weights={k: v.detach().clone()
                                             for k, v in critic.engine.module.named_parameters()})
    fixed, dynamic = results["fixed"], results["dynamic"]
    # The budget acts: first fit's count of micro-batches, none over its budget (no sequence is longer).
    assert len(dynamic["forwards"]) == first_fit_count(lengths, 45) and max(dynamic["forwards"]) <= 45
    assert len(dynamic["train_forwards"]) == first_fit_count(lengths, 30) and max(dynamic["train_forwards"]) <= 30
    assert len(fixed["train_forwards"]) == 4  # 8 sequences, 2 at a time
    mask = shard["action_mask"].bool()
    torch.testing.assert_close(dynamic["logp"][mask], fixed["logp"][mask], rtol=1e-5, atol=1e-6)
    step_size = {"actor": fixed_cfg.actor_learning_rate, "critic": fixed_cfg.critic_learning_rate}
    for role in ("actor", "critic"):
        for key, value in fixed[role].items():
            assert dynamic[role][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (role, key)
        for key, value in fixed[f"{role}_weights"].items():
            # Adam moves a weight by about the learning rate whatever its gradient's size (the gradient norm above
            # checks the gradient itself); a near-zero gradient rounded otherwise moves a little more or less.
            torch.testing.assert_close(dynamic[f"{role}_weights"][key], value, rtol=0, atol=0.1 * step_size[role],
                                       msg=lambda m, role=role, key=key: f"{role} {key}: {m}")
    moved = max(float((fixed["actor_weights"][k] - v).abs().max()) for k, v in initial.items())
    assert moved > 0.5 * step_size["actor"], "the step changed no weight: the comparison above would pass for anything"


def test_the_experience_forwards_fill_each_row_of_the_batch(sft_model):
    """Log-probs by token budget land in their rows, at the batch's width, equal to each sequence's own."""
    from stages.model_io import load_causal_lm

    cfg = parse_stage_args(STAGES["rl"], ["--config", "tiny", "--pretrain", str(sft_model), "--prompt_data", "p.jsonl", "--remote_rm_url",
                                  "stages/tiny_reward.py", "--use_dynamic_batch", "--train_max_tokens_per_gpu", "20"])
    model = load_causal_lm(sft_model).eval()
    shard = ragged_shard(seed=1)
    together = sequence_log_probs(model, shard, cfg)
    assert together.shape == shard["action_mask"].shape
    one_at_a_time = cfg.model_copy(update={"use_dynamic_batch": False, "micro_rollout_batch_size": 1})
    real = shard["attention_mask"][:, 1:].bool()  # next tokens of each sequence (the rest is padding)
    torch.testing.assert_close(together[real], sequence_log_probs(model, shard, one_at_a_time)[real], rtol=1e-5,
                               atol=1e-6)
