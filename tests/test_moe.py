"""--aux_loss_coef: the load-balancing loss of mixture-of-experts routers (stages/moe.py), on the tiny Mixtral
(stages/tiny.py: the tiny model's shape, 4 experts, top-2 routing).

Worked numbers: the loss caught from a forward is what Mixtral's CausalLM reports as `aux_loss` for the same padded
batch and mask, and the Switch Transformer formula by hand over the real tokens (a packed forward: no padding, no
mask, the same value). Each stage's micro-batch loss gains coef × aux / (the step's micro-batches over all ranks),
whose gradient reaches the routers; the RL actor's and critic's optimizer steps add the same term on a real DeepSpeed
engine; models without routers are refused naming the flag and the model; an SFT run end to end.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import built_once
from rank_workers import built, ragged_shard
from stage_runs import history_of, run_stage
from transformers import AutoModelForCausalLM

from stages import data, lora, moe, packing
from stages.cli import parse_stage_args
from stages.dpo import train as dpo
from stages.errors import StageInputError
from stages.model_io import load_causal_lm, load_tokenizer, load_value_model
from stages.registry import STAGES as STAGE_CONFIGS
from stages.reward_model import train as reward_model
from stages.rl.actor import PolicyWorker
from stages.rl.critic import CriticWorker, TokenValueModel
from stages.sequences import pad_sequences, pair_sequences
from stages.sft import train as sft
from stages.tiny import TINY_EXPERTS, TINY_TOP_K, build_tiny_model

COEF = 0.01


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory):
    """The tiny Mixtral with the tiny tokenizer (seed 0), built once."""
    return built_once(tmp_path_factory, "tiny-moe", lambda folder: build_tiny_model(folder / "model", moe=True))


def by_hand(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Switch Transformer's balancing loss over every layer's token rows: experts × Σ_e (top-k slots of e per
    row) × (mean router probability of e)."""
    probs = torch.cat(router_logits).softmax(dim=-1)
    slots = F.one_hot(probs.topk(TINY_TOP_K).indices, TINY_EXPERTS).sum(dim=1).float()
    return TINY_EXPERTS * (slots.mean(dim=0) * probs.mean(dim=0)).sum()


def tiny_sequences(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(text) for text in ("What is 3 plus 4? Answer: 7", "2 + 2 = ?", "Add 9 and 1. Answer: 10")]


def test_the_caught_loss_is_the_architectures_aux_loss_padded_and_packed(moe_model, tokenizer):
    model = load_causal_lm(moe_model)
    sequences = tiny_sequences(tokenizer)
    input_ids, attention_mask = pad_sequences(sequences, tokenizer.pad_token_id)
    with torch.no_grad():
        with moe.router_aux_losses(model) as padded:
            model(input_ids=input_ids, attention_mask=attention_mask)
        reported = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
        packed_ids, position_ids, _ = packing.pack(sequences)
        with moe.router_aux_losses(model) as packed:  # as stages/packing.py runs it
            model(input_ids=packed_ids, position_ids=position_ids, use_cache=False)
        packed_logits = model(input_ids=packed_ids, position_ids=position_ids, use_cache=False,
                              output_router_logits=True).router_logits
        model(input_ids=input_ids, attention_mask=attention_mask)  # after the block: caught by nothing
    assert len(padded) == len(packed) == 1
    torch.testing.assert_close(padded[0], reported.aux_loss)
    real = attention_mask.reshape(-1).bool()
    torch.testing.assert_close(padded[0], by_hand(tuple(logits[real] for logits in reported.router_logits)))
    torch.testing.assert_close(packed[0], by_hand(packed_logits))  # unmasked: a packed row has no padding
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)  # the same tokens, routed alike
    assert abs(float(by_hand(reported.router_logits) - padded[0])) > 1e-3, "the mask acts: pads would count"
    assert 1.0 < float(padded[0]) < TINY_EXPERTS  # top_k (2) when balanced, up to the expert count
    assert model.config.output_router_logits is False  # asked per forward: nothing left in the config


@pytest.mark.parametrize("architecture", ["Qwen2Moe", "Qwen3Moe", "Olmoe"])
def test_other_moe_families_give_their_own_aux_loss(architecture):
    """Their expert count is `num_experts` (Mixtral's `num_local_experts`), Qwen2-MoE adds a shared expert."""
    import transformers

    config = getattr(transformers, f"{architecture}Config")(
        vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOP_K, eos_token_id=None)
    model = getattr(transformers, f"{architecture}ForCausalLM")(config)
    input_ids, attention_mask = pad_sequences([[5, 6, 7, 8, 9], [10, 11, 12]], pad_token_id=0)
    with torch.no_grad(), moe.router_aux_losses(model) as caught:
        reported = model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(caught[0], reported)


def test_the_base_model_is_found_inside_lora_and_value_model_wrappers(moe_model, tokenizer):
    cfg = parse_stage_args(STAGE_CONFIGS["sft"], ["--config", "tiny", "--pretrain", str(moe_model), "--dataset", "d.jsonl",
                                   "--lora_rank", "4"])
    causal = load_causal_lm(moe_model)
    wrapped = lora.wrap(load_causal_lm(moe_model), cfg, value_model=False)
    value = TokenValueModel(load_value_model(moe_model))
    assert type(moe.base_model(wrapped)).__name__ == type(moe.base_model(value)).__name__ == "MixtralModel"
    sequences = tiny_sequences(tokenizer)
    losses = []
    with torch.no_grad():
        for model in (causal, wrapped):
            with moe.router_aux_losses(model) as caught:
                packing.padded_log_probs(model, sequences, tokenizer.pad_token_id)
            losses.append(caught[0])
        with moe.router_aux_losses(value) as caught:  # the critic's forward: the base model and its head
            value(*pad_sequences(sequences, tokenizer.pad_token_id))
        losses.append(caught[0])
    torch.testing.assert_close(losses[1], losses[0])  # fresh LoRA adapters change nothing yet
    torch.testing.assert_close(losses[2], losses[0])  # the value model shares the base model's weights


STAGES = {
    "sft": (sft, sft.SFTWorker, "sft_train"),
    "reward_model": (reward_model, reward_model.RewardModelWorker, "pref_train"),
    "dpo": (dpo, dpo.DPOWorker, "pref_train"),
}
ROUTERS = "mlp.gate.weight"  # Mixtral's router of each layer


def stage_worker(stage: str, moe_model, tokenizer, coef: float):
    """A stage worker without Ray or DeepSpeed (as tests/test_packing.py builds them), on a fresh tiny Mixtral: 32
    samples per step in micro-batches of 8 over 2 ranks, i.e. 4 micro-batches per step."""
    worker_cls = STAGES[stage][1]
    cfg = parse_stage_args(STAGE_CONFIGS[stage], ["--config", "tiny", "--pretrain", str(moe_model), "--dataset", "d.jsonl",
                                   "--max_len", "64", "--train_batch_size", "32", "--micro_train_batch_size", "8",
                                   "--num_gpus_per_node", "2", "--aux_loss_coef", str(coef)])
    worker = worker_cls.__new__(worker_cls)
    worker.cfg, worker.tokenizer, worker.rank, worker.world_size, worker.device = cfg, tokenizer, 0, 2, "cpu"
    torch.manual_seed(0)  # the reward model's fresh value head
    worker.engine = (load_value_model(moe_model) if stage == "reward_model" else load_causal_lm(moe_model)).train()
    worker.engine.config.pad_token_id = tokenizer.pad_token_id
    if stage == "dpo":
        worker.reference = load_causal_lm(moe_model).eval()
    return worker


def router_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if name.endswith(ROUTERS)}


@pytest.mark.parametrize("stage", list(STAGES))
def test_the_micro_batch_loss_adds_its_share_of_the_step_mean_aux_loss(stage, moe_model, assets, tokenizer):
    module, _, dataset = STAGES[stage]
    results = {}
    for coef in (0.0, COEF):
        worker = stage_worker(stage, moe_model, tokenizer, coef)
        examples = module.encode_rows(worker.cfg, tokenizer, data.load_rows(str(assets[dataset]), max_samples=8)).kept()
        loss, stats = worker.micro_batch_loss(examples, worker.step_normalizer(examples))
        loss.backward()
        results[coef] = loss.detach(), stats, router_grads(worker.engine)
    # The aux loss of the same batch, padded as the stage pads it, as Mixtral's CausalLM reports it (a value model
    # routes with the same base model).
    sequences = [e["input_ids"] for e in examples] if stage == "sft" else pair_sequences(examples)
    input_ids, attention_mask = pad_sequences(sequences, tokenizer.pad_token_id)
    aux_model = load_causal_lm(moe_model)
    aux = aux_model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True).aux_loss
    step_micro_batches = 4
    (plain_loss, plain_stats, plain_grads), (loss, stats, grads) = results[0.0], results[COEF]
    assert "aux_loss" not in plain_stats
    assert stats["aux_loss"] == pytest.approx(aux.item() / step_micro_batches, rel=1e-5)
    assert stats["loss"] == pytest.approx(plain_stats["loss"], rel=1e-6)  # the task loss is logged on its own
    torch.testing.assert_close(loss, plain_loss + COEF * aux.detach() / step_micro_batches)
    # The router gets the task's gradient without the term, and the term's gradient on top with it.
    (COEF * aux / step_micro_batches).backward()
    aux_grads = router_grads(aux_model)
    assert len(grads) == 2 and all(float(g.abs().max()) > 0 for g in plain_grads.values())
    for name, grad in grads.items():
        assert float((grad - plain_grads[name]).abs().max()) > 1e-3 * float(plain_grads[name].abs().max()), name
        torch.testing.assert_close(grad - plain_grads[name], aux_grads[name], rtol=1e-3,
                                   atol=1e-4 * float(aux_grads[name].abs().max()))


def test_a_model_without_routers_is_refused_naming_the_flag_and_the_model(assets, moe_model):
    dense = load_causal_lm(assets["model"])
    moe.check_router(dense, 0.0, assets["model"])  # without the flag, any model
    moe.check_router(load_causal_lm(moe_model), COEF, moe_model)
    with pytest.raises(StageInputError) as refused:
        moe.check_router(load_value_model(assets["model"]), COEF, assets["model"])
    message = str(refused.value)
    assert message.startswith("--aux_loss_coef 0.01 weighs the load-balancing loss")
    assert f"model {assets['model']} has none: LlamaModel is not a mixture-of-experts model (its config has no " \
           "output_router_logits); set --aux_loss_coef 0" in message


def test_the_flag_is_a_non_negative_weight_of_sft_rm_dpo_and_rl_only(capsys):
    base = ["--config", "tiny", "--pretrain", "m", "--dataset", "d.jsonl"]
    for stage in ("sft", "reward_model", "dpo"):
        assert parse_stage_args(STAGE_CONFIGS[stage], [*base, "--aux_loss_coef", "0.01"]).aux_loss_coef == 0.01
        assert parse_stage_args(STAGE_CONFIGS[stage], base).aux_loss_coef == 0.0
    assert parse_stage_args(STAGE_CONFIGS["rl"], ["--config", "tiny", "--pretrain", "m", "--prompt_data", "p.jsonl",
                                   "--remote_rm_url", "r.py", "--aux_loss_coef", "0.01"]).aux_loss_coef == 0.01
    for stage, flags in (("sft", ["--aux_loss_coef", "-0.1"]), ("kto", ["--aux_loss_coef", "0.01"])):
        with pytest.raises(SystemExit) as exit_info:
            parse_stage_args(STAGE_CONFIGS[stage], [*base, *flags])
        assert exit_info.value.code == 2
        assert "--aux_loss_coef" in capsys.readouterr().err


def rl_config(pretrain, coef: float):
    """PPO on one rank: 8 sequences per optimizer step in 4 micro-batches of 2."""
    return parse_stage_args(STAGE_CONFIGS["rl"], [
        "--config", "tiny", "--pretrain", str(pretrain), "--advantage_estimator", "gae", "--prompt_data", "p.jsonl",
        "--train_batch_size", "8", "--rollout_batch_size", "2", "--n_samples_per_prompt", "4",
        "--micro_rollout_batch_size", "2", "--micro_train_batch_size", "2", "--remote_rm_url",
        "stages/tiny_reward.py", "--aux_loss_coef", str(coef)])


def recorded_backward(worker, monkeypatch) -> list[float]:
    """The loss of each backward of `worker`'s engine (after the trainer's global loss scale)."""
    losses: list[float] = []
    backward = worker.engine.backward

    def record(loss, *args, **kwargs):
        losses.append(float(loss))
        return backward(loss, *args, **kwargs)

    monkeypatch.setattr(worker.engine, "backward", record)
    return losses


@pytest.mark.usefixtures("one_deepspeed_rank")
def test_the_actor_and_critic_steps_add_the_step_mean_aux_loss(moe_model, monkeypatch):
    shard = ragged_shard()
    step = {"step_tokens": float(shard["action_mask"].sum())}
    results = {}
    for coef in (0.0, COEF):
        cfg = rl_config(moe_model, coef)
        actor, critic = built(PolicyWorker, cfg), built(CriticWorker, cfg)
        if coef:
            with torch.no_grad():  # each micro-batch's aux loss, before the step moves the weights
                micro = [shard_part(shard, start) for start in range(0, 8, 2)]
                actor_aux = [aux_of(actor.engine, part) for part in micro]
                critic_aux = [aux_of(critic.engine, part) for part in micro]
        losses = {"actor": recorded_backward(actor, monkeypatch), "critic": recorded_backward(critic, monkeypatch)}
        totals = {"actor": actor.train_step(shard, step_sequences=8, kl_coef=0.01, **step),
                  "critic": critic.train_step(shard, **step)}
        results[coef] = totals, losses
    (plain_totals, plain_losses), (totals, losses) = results[0.0], results[COEF]
    step_micro_batches = 4  # 4 on this rank × 1 rank
    for role, key, aux in (("actor", "aux_loss", actor_aux), ("critic", "critic_aux_loss", critic_aux)):
        assert key not in plain_totals[role]
        assert totals[role][key] == pytest.approx(sum(aux) / step_micro_batches, rel=1e-5)
        # The engine's loss of each micro-batch (× the global loss scale, 4 accumulation steps × 1 rank) gains
        # coef × its aux loss / the step's micro-batches: scaled back, coef × its aux loss.
        gained = [with_aux - without for with_aux, without in zip(losses[role], plain_losses[role])]
        assert gained == pytest.approx([COEF * a for a in aux], rel=1e-4)
    assert totals["actor"]["policy_loss"] == pytest.approx(plain_totals["actor"]["policy_loss"], rel=1e-6)
    assert totals["critic"]["critic_loss"] == pytest.approx(plain_totals["critic"]["critic_loss"], rel=1e-6)


def shard_part(shard: dict[str, torch.Tensor], start: int) -> dict[str, torch.Tensor]:
    return {key: value[start : start + 2] for key, value in shard.items()}


def aux_of(engine, micro: dict[str, torch.Tensor]) -> float:
    """The aux loss of a micro-batch's padded forward, as the actor's and critic's training forwards run it."""
    with moe.router_aux_losses(engine) as caught:
        engine(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])
    return float(caught[0])


@pytest.mark.usefixtures("one_deepspeed_rank")
def test_the_rl_models_without_routers_are_refused_when_loaded(assets):
    for worker_cls in (PolicyWorker, CriticWorker):
        with pytest.raises(StageInputError, match=f"--aux_loss_coef 0.01 .* model {assets['model']} has none"):
            built(worker_cls, rl_config(assets["model"], COEF))


@pytest.mark.slow  # a stage run
def test_an_sft_run_with_the_aux_loss_logs_it_and_exports_a_loadable_model(assets, moe_model, tmp_path):
    out = tmp_path / "model"
    proc = run_stage("sft", "--pretrain", moe_model, "--dataset", assets["sft_train"], "--aux_loss_coef", COEF,
                     "--max_samples", 64, "--max_epochs", 1, "--logging_steps", 1, "--save_path", out,
                     "--ckpt_path", tmp_path / "ckpt")
    history = history_of(out)
    assert len(history) == 2  # 64 samples, 32 per step
    assert all(1.0 < record["aux_loss"] < TINY_EXPERTS for record in history), history
    assert "aux_loss=" in proc.stdout
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "MixtralForCausalLM" and exported.config.output_router_logits is False
    prompt = torch.tensor([load_tokenizer(out).encode("What is 3 plus 4?")])
    # transformers' cached generate fails with output_router_logits in the config: it must not travel with the model.
    assert exported.generate(prompt, min_new_tokens=3, max_new_tokens=3, do_sample=False).shape == (1, prompt.shape[1] + 3)


@pytest.mark.slow  # a stage run
def test_an_sft_run_on_a_dense_model_with_the_flag_stops_before_any_rank_starts(assets, tmp_path):
    proc = run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"], "--aux_loss_coef", COEF,
                     "--max_samples", 64, "--save_path", tmp_path / "model", "--ckpt_path", tmp_path / "ckpt",
                     expect_rc=2)
    assert f"--aux_loss_coef 0.01 weighs the load-balancing loss of mixture-of-experts routers, but model " \
           f"{assets['model']} has none: its config has no output_router_logits" in proc.stderr
    assert "SFTWorker" not in proc.stdout + proc.stderr and not (tmp_path / "model").exists()
