"""The RL stage's config (OpenRLHF's train_ppo_ray flags): its flags, their defaults and the combinations it refuses."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from stages.config import (
    PARAMETERS_IN_HOST_MEMORY, OutputPath, PolicyPath, PromptConfig, RouterBalancing, ScorerPath, StrictModel,
    TrainingConfig,
    ckpt_path_field, eval_split_field, max_samples_field, micro_train_batch_size_field, mixture_probs_field,
    parse_probabilities,
)
from stages.fields import NOT_TRAINING, RUN_OVERRIDE, GpuOnly
from stages.rl.estimators import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS

AdvantageEstimator = Literal[ADVANTAGE_ESTIMATORS]  # type: ignore[valid-type]
KLEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]


class RLPlacement(StrictModel):
    """Where the RL models and the rollout engines run (OpenRLHF's placement flags): ranks per model, colocation,
    GPU sleep between phases, the weight sync to the engines."""

    actor_num_nodes: int = Field(1, ge=1, description="nodes for the actor")
    actor_num_gpus_per_node: int = Field(8, ge=1, description="ranks per node for the actor")
    critic_num_nodes: int = Field(1, ge=1, description="nodes for the critic (gae only)")
    critic_num_gpus_per_node: int = Field(8, ge=1, description="ranks per node for the critic (gae only)")
    ref_num_nodes: int = Field(1, ge=1, description="nodes for the reference model")
    ref_num_gpus_per_node: int = Field(8, ge=1, description="ranks per node for the reference model")
    reward_num_nodes: int = Field(1, ge=1, description="nodes for the reward model")
    reward_num_gpus_per_node: int = Field(8, ge=1, description="ranks per node for the reward model")
    colocate_actor_ref: bool = Field(False, description="actor and reference model share GPUs")
    colocate_critic_reward: bool = Field(False, description="critic and reward model share GPUs")
    colocate_all_models: bool = Field(False, description="all models and the vLLM engines share GPUs (hybrid engine)")
    vllm_enable_sleep: Annotated[bool, GpuOnly(False, "vLLM's sleep mode releases GPU memory; CPU engines keep "
                                                      "theirs")] = Field(
        False, description="vLLM engines release GPU memory while the models train (needs --colocate_all_models)",
    )
    deepspeed_enable_sleep: Annotated[bool, GpuOnly(False, "it moves optimizer states off the GPU between phases; on "
                                                           "CPU they already are")] = Field(
        False, description="DeepSpeed models release GPU memory while vLLM generates (needs --colocate_all_models)",
    )
    ref_reward_offload: Annotated[bool, GpuOnly(False, PARAMETERS_IN_HOST_MEMORY)] = Field(
        False, description="keep the reference and reward models' ZeRO-3 partitions in host memory, fetched layer by "
        "layer for their forwards (needs --zero_stage 3)",
    )
    vllm_sync_backend: Annotated[Literal["nccl", "gloo"], GpuOnly("gloo", "NCCL needs GPUs; the weight sync uses "
                                                                          "gloo on CPU")] = Field(
        "nccl",
        description="torch.distributed backend of the group that broadcasts the actor's weights to the rollout "
        "engines after each step (nccl on GPUs, gloo on CPU)",
    )
    vllm_sync_bucket_mb: int = Field(
        256, ge=1,
        description="weight sync sends parameters in buckets of at most this many MiB (ZeRO-3 gathers one bucket at "
        "a time), never the whole model at once",
    )


class RolloutSettings(StrictModel):
    """What a rollout is: prompts and samples per step, sampling, which groups are kept, and how its sequences are
    batched for the forwards."""

    num_episodes: Annotated[int, RUN_OVERRIDE] = Field(1, ge=1, description="passes over the prompt dataset")
    rollout_batch_size: int = Field(
        1024, ge=1, description="prompts per rollout (each sampled --n_samples_per_prompt times)",
    )
    n_samples_per_prompt: int | None = Field(
        None, ge=1,
        description="responses sampled per prompt; unset: 8 for group_norm, rloo, dr_grpo, reinforce_baseline (where "
        "OpenRLHF's default of 1 is refused), else 1",
    )
    temperature: float = Field(1.0, ge=0, description="sampling temperature of rollouts (must be > 0)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling probability mass of rollouts")
    dynamic_filtering: bool = Field(
        False,
        description="DAPO dynamic sampling: drop prompt groups whose mean score lies outside "
        "--dynamic_filtering_reward_range (no learning signal) and sample further prompts until the rollout is full",
    )
    dynamic_filtering_reward_range: tuple[float, float] = Field(
        (0.0, 1.0), description="a group is kept when low < mean score of its samples < high",
    )
    vllm_generate_batch_size: int | None = Field(
        None, ge=1,
        description="prompts per generate call when a rollout needs new samples; above --rollout_batch_size "
        "(needs --async_train) the extra groups are kept for the following steps; unset: --rollout_batch_size",
    )
    use_dynamic_batch: bool = Field(
        False,
        description="micro-batches by token budget instead of by count (OpenRLHF's meaning): each rank's sequences "
        "are balanced over as few micro-batches of --train_max_tokens_per_gpu tokens (training) or "
        "--rollout_max_tokens_per_gpu (log-probs, values, rewards) as the rank needing most takes; "
        "--micro_train_batch_size and --micro_rollout_batch_size are then unused. Best with --packing_samples",
    )
    train_max_tokens_per_gpu: int = Field(
        16192, ge=1,
        description="--use_dynamic_batch: tokens (prompt + response) per training micro-batch on one rank; a longer "
        "sequence gets a micro-batch of its own",
    )
    rollout_max_tokens_per_gpu: int | None = Field(
        None, ge=1,
        description="--use_dynamic_batch: tokens per micro-batch of the experience forwards (log-probs, values, "
        "rewards) on one rank; unset: --train_max_tokens_per_gpu",
    )


class AlgorithmSettings(StrictModel):
    """The RL algorithm: learning rates, advantage estimator, reward shaping, KL, the policy and value losses
    (stages/rl/algorithms.py)."""

    actor_learning_rate: float = Field(1e-6, gt=0, description="peak learning rate of the actor")
    critic_learning_rate: float = Field(9e-6, gt=0, description="peak learning rate of the critic (gae only)")
    advantage_estimator: AdvantageEstimator = Field(
        "gae",
        description="gae (PPO, needs a critic), reinforce (REINFORCE++), reinforce_baseline, rloo, "
        "group_norm (GRPO), dr_grpo",
    )
    no_advantage_std_norm: bool = Field(
        False, description="whiten gae, reinforce and reinforce_baseline advantages by the batch mean only, without "
        "dividing by the std; no effect on group_norm (always ÷ group std), rloo and dr_grpo",
    )
    reward_clip_range: tuple[float, float] = Field(
        (-10.0, 10.0), description="clip scalar rewards to [low, high], after the group baseline and length penalties",
    )
    overlong_buffer_len: int | None = Field(
        None, ge=1, description="DAPO overlong penalty: tokens before --generate_max_len where the penalty starts",
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="DAPO overlong penalty at --generate_max_len")
    stop_properly_penalty_coef: float | None = Field(
        None, le=1, description="truncated responses: reward × coef for coef in [0, 1], reward = coef if < 0",
    )
    init_kl_coef: float = Field(
        0.01, ge=0, description="KL coefficient β to the reference model; 0 = no reference model",
    )
    kl_target: float | None = Field(
        None, gt=0, description="target KL of the adaptive KL controller; unset: fixed --init_kl_coef",
    )
    kl_horizon: int = Field(10000, ge=1, description="horizon (samples) of the adaptive KL controller")
    use_kl_loss: bool = Field(False, description="add the KL to the actor loss (GRPO) instead of to the reward")
    kl_estimator: KLEstimator = Field(
        "k1", description="KL estimator: k1 (log ratio), k2 (squared / 2), k3 (exp(-d) - 1 + d)",
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO ratio clip range")
    eps_clip_low_high: tuple[float, float] | None = Field(
        None, description="separate low and high ratio clip ranges; unset: --eps_clip both",
    )
    dual_clip: float | None = Field(
        None, gt=1, description="dual-clip PPO bound c > 1 for negative advantages; unset: off",
    )
    policy_loss_type: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo", description="ppo: token ratios, loss averaged over the step's tokens; gspo: one ratio per sequence "
        "(exp of its mean token log-ratio), loss averaged per sequence then over the step's sequences; cispo "
        "(MiniMax-M1): the token ratio clipped to [1 - low, 1 + high] of --eps_clip / --eps_clip_low_high and "
        "detached, times the token's log-prob times its advantage, averaged over the step's tokens (no token loses "
        "its gradient)",
    )
    entropy_loss_coef: float | None = Field(
        None, ge=0,
        description="subtract coef × token entropy from the actor loss; unset: entropy is not computed, 0: logged only",
    )
    freezing_actor_steps: int = Field(
        -1, ge=-1, description="train only the critic for the first N steps (critic warm-up, gae); -1 = never",
    )
    value_clip: float = Field(0.5, gt=0, description="critic value clip range")
    gamma: float = Field(1.0, gt=0, le=1, description="discount factor")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda")


class AsyncSettings(StrictModel):
    """Off-policy training: rollouts produced ahead of training (--async_train), partial rollouts, and the
    correction for the engines' sampling distribution."""

    async_train: bool = Field(
        False,
        description="generate the next rollouts while the actor trains on the current ones (OpenRLHF's async "
        "trainer): the rollout of step k is sampled by the policy of step k - --async_queue_size, exactly, so runs "
        "repeat and resume like synchronous ones",
    )
    async_queue_size: int = Field(
        1, ge=1, description="--async_train: rollouts generated ahead of training, i.e. policy versions a rollout lags",
    )
    partial_rollout: bool = Field(
        False,
        description="--async_train: a weight update does not wait for the rollout being generated; it lands between "
        "generation segments of --partial_rollout_segment_len tokens and the responses go on with the new weights, so "
        "one response may come from two policy versions (logged as mixed_version_samples; weigh it with "
        "--enable_vllm_is_correction). A resumed run repeats the interrupted one's prompts, not its samples",
    )
    partial_rollout_segment_len: int = Field(
        64, ge=1, description="--partial_rollout: tokens generated per response between two chances of a weight update",
    )
    enable_vllm_is_correction: bool = Field(
        False,
        description="off-policy correction: weigh each token's policy loss by the ratio of the trainer's probability "
        "to the rollout engine's (the policy that sampled, an older one with --async_train), truncated or masked "
        "as --vllm_is_correction_type says; with --policy_loss_type gspo the engines' log-probs are the ratio's base",
    )
    vllm_is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = Field(
        "tis",
        description="tis: clamp token ratios to --vllm_is_truncated_threshold; icepop: drop tokens outside it; "
        "seq-mask-tis: drop sequences whose geometric-mean ratio lies outside it",
    )
    vllm_is_truncated_threshold: tuple[float, float] = Field(
        (0.5, 5.0), description="low and high bounds of the importance ratio (--enable_vllm_is_correction)",
    )


class OutputGuards(StrictModel):
    """What the run keeps and watches: the best checkpoint, drift warnings, the EMA of the actor, the critic's export."""

    save_best: bool = Field(
        False,
        description="keep the actor with the best held-out greedy reward (evaluated every --eval_steps) and make "
        "it the stage's output instead of the last one",
    )
    drift_max_kl: float = Field(
        1.0, gt=0,
        description="training guard: warn when the KL to the reference (token mean, as logged) exceeds this (nats)",
    )
    drift_max_truncated_fraction: float = Field(
        0.5, gt=0, le=1, description="training guard: warn when more than this fraction of responses hit the length cap",
    )
    drift_length_ratio: float = Field(
        3.0, gt=1,
        description="training guard: warn when the mean response length grows or shrinks by more than this factor "
        "from the first step's",
    )
    weight_sync_check_interval: Annotated[int, NOT_TRAINING] = Field(
        1, ge=1,
        description="check that every rollout engine computes with the actor's weights after every N-th weight sync "
        "(what the actor sent, read back from each engine worker's layers, and a probe batch's log-probs from both); "
        "the start-up and the first sync are always checked. A mismatch stops the stage naming the tensor and engine",
    )
    logprob_gap_warn: Annotated[float, NOT_TRAINING] = Field(
        0.1, gt=0,
        description="training guard: warn when the rollout engines' log-probs of the sampled tokens differ from the "
        "actor's (before its update) by more than this on average (nats per token, logged as logprob_gap_mean)",
    )
    logprob_gap_stop: Annotated[float | None, NOT_TRAINING] = Field(
        1.0, gt=0,
        description="stop the stage when logprob_gap_mean exceeds this: the engines no longer sample from the policy "
        "being trained; unset: never stop on it",
    )
    enable_ema: bool = Field(
        False,
        description="keep an exponential moving average of the actor's weights (updated after each optimizer step, "
        "in fp32 host memory) and export it as the stage's output instead of the last actor; rollouts and the "
        "in-training evaluation use the actor itself",
    )
    ema_beta: float = Field(
        0.992, gt=0, lt=1, description="--enable_ema: average <- ema_beta * average + (1 - ema_beta) * weights",
    )
    save_value_network: Annotated[bool, NOT_TRAINING] = Field(
        False, description="also export the trained critic (gae) as an HF value model to <save_path>_critic",
    )


class RLConfig(RolloutSettings, AlgorithmSettings, AsyncSettings, RLPlacement, OutputGuards, RouterBalancing,
               TrainingConfig, PromptConfig):
    """Online RL (PPO, GRPO, RLOO, REINFORCE++ ...) with Ray roles: `python -m stages.rl` (OpenRLHF's train_ppo_ray)."""

    stage = "rl"
    trains_policy = True
    tiny_rows = "prompts"
    tiny_assets = {"pretrain": "model", "prompt_data": "prompts_train", "remote_rm_url": "rule_reward"}
    rank_flags = "*_num_nodes × *_num_gpus_per_node, vllm_num_engines × vllm_tensor_parallel_size"

    pretrain: PolicyPath = Field(None, description="initial actor (policy)")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model for the KL term; unset: --pretrain")
    critic_pretrain: ScorerPath = Field(
        None, description="initial critic for gae; unset: --reward_pretrain, or --pretrain with --remote_rm_url",
    )
    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints_ppo_ray")
    prompt_data_probs: str | None = mixture_probs_field("prompt_data")
    eval_split: Annotated[str, NOT_TRAINING] = eval_split_field("train")
    max_len: int | None = Field(
        None, ge=2,
        description="prompt + response token budget: each response stops at max_len - prompt length (and at "
        "--generate_max_len); unset: --prompt_max_len + --generate_max_len",
    )
    max_samples: Annotated[int, RUN_OVERRIDE] = max_samples_field(100_000_000)
    micro_train_batch_size: int = micro_train_batch_size_field(4)

    @property
    def rollout_dtype(self) -> str:
        """The rollout engines' dtype: the actor's."""
        return "bfloat16" if self.bf16 else "float32"

    @property
    def total_len(self) -> int:
        """Prompt + response token budget of one sample (the engines' max_model_len)."""
        return self.max_len or self.prompt_max_len + self.generate_max_len

    @property
    def prompt_data_probabilities(self) -> list[float] | None:
        return parse_probabilities(self.prompt_data, self.prompt_data_probs, "prompt_data", "prompt_data_probs", [])

    @property
    def generate_batch_size(self) -> int:
        return self.vllm_generate_batch_size or self.rollout_batch_size

    @property
    def train_token_budget(self) -> int | None:
        """Tokens per training micro-batch (--use_dynamic_batch); None: --micro_train_batch_size rows."""
        return self.train_max_tokens_per_gpu if self.use_dynamic_batch else None

    @property
    def rollout_token_budget(self) -> int | None:
        """Tokens per experience micro-batch (--use_dynamic_batch); None: --micro_rollout_batch_size rows."""
        if not self.use_dynamic_batch:
            return None
        return self.rollout_max_tokens_per_gpu or self.train_max_tokens_per_gpu

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "gae"

    @property
    def uses_reference(self) -> bool:
        return self.init_kl_coef > 0

    @property
    def critic_init(self) -> str | None:
        """Where the critic starts from (OpenRLHF's rule): --critic_pretrain, else the reward model, else the actor."""
        return self.critic_pretrain or self.reward_pretrain or self.pretrain

    @property
    def eps_clip_bounds(self) -> tuple[float, float]:
        return self.eps_clip_low_high or (self.eps_clip, self.eps_clip)

    @property
    def actor_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    def role_ranks(self) -> dict[str, int]:
        """Ranks of every model this config runs (critic only for gae, reference only with a KL term)."""
        ranks = {"actor": self.actor_ranks}
        if self.uses_critic:
            ranks["critic"] = self.critic_num_nodes * self.critic_num_gpus_per_node
        if self.uses_reference:
            ranks["ref"] = self.ref_num_nodes * self.ref_num_gpus_per_node
        if not (self.remote_rm_url or self.agent_func_path):
            ranks["reward"] = self.reward_num_nodes * self.reward_num_gpus_per_node
        return ranks

    def train_world_sizes(self) -> dict[str, int]:
        return {key: ranks for key, ranks in self.model_world_sizes().items() if key.startswith(("--actor", "--critic"))}

    def model_world_sizes(self) -> dict[str, int]:
        return {f"--{role}_num_nodes × --{role}_num_gpus_per_node": ranks for role, ranks in self.role_ranks().items()}

    def _resolve(self) -> None:
        if self.ring_attn_size > 1 and not self.packing_samples:
            # As OpenRLHF's RL: ring attention turns packing on (said by notes()); before the parent's resolve,
            # which lets packing turn --flash_attn on.
            self.__dict__["packing_samples"] = True
        super()._resolve()
        if self.n_samples_per_prompt is None:
            # Into __dict__: the field stays out of model_fields_set, which is how notes() tells it was unset.
            self.__dict__["n_samples_per_prompt"] = 8 if self.advantage_estimator in GROUP_ESTIMATORS else 1

    def notes(self) -> list[str]:
        notes = super().notes()
        if self.ring_attn_size > 1 and "packing_samples" not in self.model_fields_set:
            notes.append(f"--ring_attn_size {self.ring_attn_size} turns --packing_samples on, as in OpenRLHF")
        estimator = self.advantage_estimator
        if "n_samples_per_prompt" not in self.model_fields_set and estimator in GROUP_ESTIMATORS:
            notes.append(f"--n_samples_per_prompt unset: 8 samples per prompt for --advantage_estimator {estimator} "
                         "(OpenRLHF's default of 1 leaves no group to compare with, and OpenRLHF refuses it)")
        if self.use_dynamic_batch and self.rollout_max_tokens_per_gpu is None:
            notes.append(f"--rollout_max_tokens_per_gpu unset: experience micro-batches of up to "
                         f"--train_max_tokens_per_gpu {self.train_max_tokens_per_gpu} tokens")
        if self.use_dynamic_batch and not self.packing_samples:
            notes.append("--use_dynamic_batch without --packing_samples pads each micro-batch to its longest "
                         "sequence: --packing_samples lays them end to end without padding")
        if self.no_advantage_std_norm and estimator in ("group_norm", "rloo", "dr_grpo"):
            notes.append(f"--no_advantage_std_norm has no effect with --advantage_estimator {estimator}: as in "
                         "OpenRLHF it only changes the batch whitening of gae, reinforce and reinforce_baseline"
                         + (" (group_norm always divides by the group's std)" if estimator == "group_norm" else ""))
        return notes

    def _problems(self) -> list[str]:
        problems = super()._problems()
        problems += self._placement_problems()
        problems += self._algorithm_problems()
        parse_probabilities(self.prompt_data, self.prompt_data_probs, "prompt_data", "prompt_data_probs", problems)
        if self.logprob_gap_stop is not None and self.logprob_gap_stop <= self.logprob_gap_warn:
            problems.append(f"--logprob_gap_stop {self.logprob_gap_stop:g} must be above --logprob_gap_warn "
                            f"{self.logprob_gap_warn:g}: the run would stop on what it should only warn about")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % self.train_batch_size:
            problems.append(
                f"--rollout_batch_size {self.rollout_batch_size} × --n_samples_per_prompt {self.n_samples_per_prompt}"
                f" = {samples} samples is not a multiple of --train_batch_size {self.train_batch_size}"
            )
        actor_groups = self.actor_ranks // self.ring_attn_size  # the ranks of a ring share micro-batches
        if not self.use_dynamic_batch and samples // self.micro_rollout_batch_size < actor_groups:
            problems.append(
                f"{samples} rollout samples / --micro_rollout_batch_size {self.micro_rollout_batch_size} = "
                f"{samples // self.micro_rollout_batch_size} micro-batches, fewer than the {actor_groups} "
                "data-parallel actor ranks"
            )
        if self.temperature == 0:
            problems.append("--temperature 0 is greedy decoding: RL needs sampling, use a temperature > 0")
        return problems

    def _placement_problems(self) -> list[str]:
        problems = []
        for flag in ("vllm_enable_sleep", "deepspeed_enable_sleep"):
            if getattr(self, flag) and not self.colocate_all_models:
                problems.append(f"--{flag} requires --colocate_all_models (sleep frees GPUs shared between models)")
        if self.deepspeed_enable_sleep and self.zero_stage == 0:
            problems.append("--deepspeed_enable_sleep moves ZeRO's optimizer states off the GPUs: it needs "
                            "--zero_stage 1, 2 or 3, got --zero_stage 0 (DeepSpeed's ZeRO-0 optimizer has no "
                            "offload_states)")
        if self.deepspeed_enable_sleep and self.adam_offload and self.zero_stage == 3:
            # DeepSpeed's ZeRO-3 offload_states takes only FusedAdam's states (runtime/zero/stage3.py asserts it).
            problems.append("--deepspeed_enable_sleep with --adam_offload under --zero_stage 3: the Adam states live "
                            "in host memory already (DeepSpeedCPUAdam), and ZeRO-3 can offload only FusedAdam's; "
                            "drop one of the two flags")
        if self.rollout_backend == "hf" and self.vllm_enable_sleep:
            problems.append("--vllm_enable_sleep needs vLLM engines: not with --rollout_backend hf")
        ranks = self.role_ranks()
        if self.colocate_all_models:
            engine_gpus = self.vllm_num_engines * self.vllm_tensor_parallel_size
            # Engines share the actor's bundles, one engine rank per bundle at most.
            if engine_gpus > self.actor_ranks:
                problems.append(
                    f"--colocate_all_models needs --vllm_num_engines × --vllm_tensor_parallel_size ({engine_gpus}) "
                    f"at most --actor_num_nodes × --actor_num_gpus_per_node ({self.actor_ranks})"
                )
            for role, count in ranks.items():
                if count != self.actor_ranks:
                    problems.append(
                        f"--colocate_all_models needs as many {role} ranks as actor ranks: --{role}_num_nodes × "
                        f"--{role}_num_gpus_per_node = {count}, actor = {self.actor_ranks}"
                    )
        elif self.colocate_actor_ref and "ref" in ranks and ranks["ref"] != self.actor_ranks:
            problems.append(
                f"--colocate_actor_ref needs --ref_num_nodes × --ref_num_gpus_per_node ({ranks['ref']}) equal to "
                f"--actor_num_nodes × --actor_num_gpus_per_node ({self.actor_ranks})"
            )
        if (not self.colocate_all_models and self.colocate_critic_reward and "critic" in ranks and "reward" in ranks
                and ranks["critic"] != ranks["reward"]):
            problems.append(
                f"--colocate_critic_reward needs --critic_num_nodes × --critic_num_gpus_per_node ({ranks['critic']}) "
                f"equal to --reward_num_nodes × --reward_num_gpus_per_node ({ranks['reward']})"
            )
        return problems

    def _algorithm_problems(self) -> list[str]:
        problems = []
        estimator = self.advantage_estimator
        if estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            problems.append(
                f"--advantage_estimator {estimator} needs --n_samples_per_prompt >= 2 (its baseline is the other "
                f"samples of the same prompt), got {self.n_samples_per_prompt}"
            )
        if self.remote_rm_url and self.reward_pretrain:
            problems.append(
                "--remote_rm_url and --reward_pretrain both set: choose one reward source "
                "(initialise a PPO critic with --critic_pretrain)"
            )
        if self.normalize_reward and (self.remote_rm_url or self.agent_func_path):
            problems.append(
                "--normalize_reward uses the reward model's stored mean/std: it does not apply to --remote_rm_url or --agent_func_path"
            )
        if self.init_kl_coef == 0:
            if self.use_kl_loss:
                problems.append("--use_kl_loss with --init_kl_coef 0 adds nothing: set --init_kl_coef > 0")
            if self.kl_estimator != "k1":
                problems.append(f"--kl_estimator {self.kl_estimator} is unused with --init_kl_coef 0 (no KL term)")
            if self.kl_target is not None:
                problems.append("--kl_target adapts --init_kl_coef, which is 0: set --init_kl_coef > 0")
        if self.enable_ema:
            if self.lora_rank:
                problems.append("--enable_ema averages the actor's full weights: not with --lora_rank (merge the "
                                "adapters first, or train without EMA)")
            if self.save_best:
                problems.append("--enable_ema and --save_best exclude each other: --save_best keeps the evaluated "
                                "actor, and the averaged weights are never the ones evaluated")
        elif self.ema_beta != type(self).model_fields["ema_beta"].default:
            problems.append(f"--ema_beta {self.ema_beta} configures --enable_ema, which is off")
        if self.ref_reward_offload and self.zero_stage != 3:
            problems.append(f"--ref_reward_offload offloads ZeRO-3 partitions: it needs --zero_stage 3, got "
                            f"{self.zero_stage}")
        if self.save_value_network and not self.uses_critic:
            problems.append(f"--save_value_network exports the critic, which --advantage_estimator {estimator} "
                            "does not train (only gae has one)")
        if self.freezing_actor_steps > 0 and not self.uses_critic:
            problems.append(
                f"--freezing_actor_steps {self.freezing_actor_steps} warms up a critic: it needs --advantage_estimator gae"
            )
        if self.dynamic_filtering:
            if self.n_samples_per_prompt < 2:
                problems.append("--dynamic_filtering drops groups whose samples all score alike: it needs "
                                "--n_samples_per_prompt >= 2")
            if not (self.remote_rm_url or self.agent_func_path):
                problems.append("--dynamic_filtering compares scores with --dynamic_filtering_reward_range: it needs a "
                                "rule reward (--remote_rm_url) or an agent's, not a reward model")
            low, high = self.dynamic_filtering_reward_range
            if low >= high:
                problems.append(f"--dynamic_filtering_reward_range {low} {high}: low must be below high")
        problems += self._off_policy_problems()
        if self.save_best and not (self.eval_dataset and self.eval_steps > 0):
            problems.append("--save_best keeps the best evaluated actor: it needs --eval_dataset and --eval_steps > 0")
        low, high = self.reward_clip_range
        if low >= high:
            problems.append(f"--reward_clip_range {low} {high}: low must be below high")
        if self.policy_loss_type == "cispo" and self.dual_clip is not None:
            problems.append(f"--dual_clip {self.dual_clip} bounds PPO's clipped objective: --policy_loss_type cispo "
                            "has none (its clipped weight is detached and scales every token's gradient)")
        if self.eps_clip_low_high is not None and min(self.eps_clip_low_high) <= 0:
            problems.append("--eps_clip_low_high: both clip ranges must be > 0")
        if self.overlong_buffer_len is not None and self.overlong_buffer_len >= self.generate_max_len:
            problems.append(
                f"--overlong_buffer_len {self.overlong_buffer_len} must be below --generate_max_len "
                f"{self.generate_max_len}"
            )
        return problems

    def _off_policy_problems(self) -> list[str]:
        problems = []
        defaults = type(self).model_fields
        if not self.async_train:
            if self.async_queue_size != defaults["async_queue_size"].default:
                problems.append(f"--async_queue_size {self.async_queue_size} configures --async_train, which is off")
            if self.partial_rollout:
                problems.append("--partial_rollout lets a weight update land during generation ahead of training: it "
                                "needs --async_train")
            if self.generate_batch_size > self.rollout_batch_size:
                problems.append(f"--vllm_generate_batch_size {self.vllm_generate_batch_size} > --rollout_batch_size "
                                f"{self.rollout_batch_size} keeps groups for later steps: it needs --async_train")
        else:
            if self.colocate_all_models:
                problems.append("--async_train generates while the actor trains, and --colocate_all_models puts the "
                                "engines on the actor's GPUs, both in memory at once; colocate the DeepSpeed models "
                                "only (--colocate_actor_ref, --colocate_critic_reward)")
            if self.vllm_enable_sleep:
                problems.append("--async_train keeps the engines generating: not with --vllm_enable_sleep")
        if not self.use_dynamic_batch:
            for flag in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
                if getattr(self, flag) != defaults[flag].default:
                    problems.append(f"--{flag} {getattr(self, flag)} configures --use_dynamic_batch, which is off")
        segment_len = self.partial_rollout_segment_len
        if not self.partial_rollout and segment_len != defaults["partial_rollout_segment_len"].default:
            problems.append(f"--partial_rollout_segment_len {segment_len} configures "
                            "--partial_rollout, which is off")
        if self.partial_rollout and self.agent_func_path:
            problems.append("--partial_rollout generates responses in segments, an agent's episodes in turns: not "
                            "with --agent_func_path")
        if self.generate_batch_size < self.rollout_batch_size:
            problems.append(f"--vllm_generate_batch_size {self.vllm_generate_batch_size} is below --rollout_batch_size "
                            f"{self.rollout_batch_size}: a generate call would not fill one rollout")
        if not self.enable_vllm_is_correction:
            for flag in ("vllm_is_correction_type", "vllm_is_truncated_threshold"):
                if getattr(self, flag) != defaults[flag].default:
                    problems.append(f"--{flag} configures --enable_vllm_is_correction, which is off")
        low, high = self.vllm_is_truncated_threshold
        if not 0 <= low < 1 < high:
            problems.append(f"--vllm_is_truncated_threshold {low} {high}: needs 0 <= low < 1 < high (a ratio of 1, "
                            "trainer and engine agreeing, must pass)")
        return problems
