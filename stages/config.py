"""Pydantic configs of every stage, and the presets they are read from.

Field names are OpenRLHF's flag names, so its commands run with our module paths (stages/cli.py builds the flags):

    python -m stages.rl --config llama3-8b --advantage_estimator group_norm
    deepspeed --module stages.reward_model --pretrain meta-llama/Meta-Llama-3-8B --dataset ... --zero_stage 3

A stage's values are the `<stage>:` section of a preset (`--config tiny`, `--config llama3-8b` or a YAML path)
overridden by flags. The merged values are validated; impossible combinations are rejected naming the flags.
Each field declares what it is (stages/fields.py: dataset, model, output, ...) where it is defined.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from stages.estimators import ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS
from stages.fields import LAUNCHER, NOT_TRAINING, OUTPUT, REWARD_SOURCE, RUN_OVERRIDE, Dataset, GpuOnly, ModelPath
from stages.fingerprint import mixture_parts

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

Device = Literal["auto", "cpu", "cuda"]
AdvantageEstimator = Literal[ADVANTAGE_ESTIMATORS]  # type: ignore[valid-type]
KLEstimator = Literal[KL_ESTIMATORS]  # type: ignore[valid-type]
RolloutBackend = Literal["auto", "vllm", "hf"]
# transformers' schedulers that need nothing beyond warmup and total steps
LRScheduler = Literal[
    "cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup", "polynomial", "inverse_sqrt",
    "cosine_with_restarts",
]

# Field types whose role is the same wherever they appear.
OutputPath = Annotated[str, OUTPUT]
BaseModelPath = Annotated[str | None, ModelPath("base")]
PolicyPath = Annotated[str | None, ModelPath("policy")]
ScorerPath = Annotated[str | None, ModelPath("scorer")]


PARAMETERS_IN_HOST_MEMORY = "on CPU the parameters already live in host memory"


class ConfigError(ValueError):
    """A preset or config that cannot be loaded or validated; the message names the file and the field."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- fields repeated with stage-specific defaults

def _learning_rate(default: float) -> Any:
    return Field(default, gt=0, description="peak learning rate of the AdamW optimizer")


def _ckpt_path(default: str) -> Any:
    return Field(default, description="directory for resumable checkpoints; a restarted stage resumes from the newest")


def _micro_train_batch_size(default: int) -> Any:
    return Field(default, ge=1, description="samples per forward/backward pass on one rank")


def _max_epochs(default: int) -> Any:
    return Field(default, ge=1, description="passes over the training data (RL: over each rollout batch)")


def _max_len(default: int | None) -> Any:
    return Field(default, ge=1, description="maximum tokens per sample (prompt + response); longer ones are truncated")


def _max_samples(default: int) -> Any:
    return Field(default, ge=1, description="use at most this many rows of each dataset")


def _eval_split(default: str) -> Any:
    return Field(default, description="split of --eval_dataset to read (a single file is the split itself)")


def _mixture_probs(sources_flag: str) -> Any:
    return Field(
        None,
        description=f"sampling probabilities of the comma-separated datasets of --{sources_flag} (e.g. 0.7,0.3): "
        "they are interleaved, seeded, until each is used up; unset: read one after the other",
    )


def parse_probabilities(sources: str | None, probs: str | None, sources_flag: str, flag: str,
                        problems: list[str]) -> list[float] | None:
    """--dataset_probs "0.7,0.3" as floats, one per dataset of the mixture, positive, summing to 1."""
    if probs is None:
        return None
    try:
        values = [float(part) for part in probs.split(",")]
    except ValueError:
        problems.append(f"--{flag} {probs!r}: expected comma-separated numbers, e.g. 0.7,0.3")
        return None
    count = len(mixture_parts(sources)) if sources else 0
    if count < 2:
        problems.append(f"--{flag} mixes datasets: give --{sources_flag} as a comma-separated list of two or more")
    elif len(values) != count:
        problems.append(f"--{flag} has {len(values)} probabilities for the {count} datasets of --{sources_flag}")
    if any(value <= 0 for value in values) or abs(sum(values) - 1) > 1e-6:
        problems.append(f"--{flag} {probs}: each probability must be > 0 and together they must sum to 1")
    return values


# ---------------------------------------------------------------- shared field groups

class StageConfig(StrictModel):
    """Fields every stage has, and the hook that rejects impossible combinations."""

    # Groups of fields a run cannot do without; in a group any one is enough. Checked by parse_stage_args.
    required_inputs: ClassVar[tuple[tuple[str, ...], ...]] = ()

    device: Device = Field("auto", description="where ranks run: cuda, cpu, or auto (cuda when the cluster has GPUs)")
    seed: Annotated[int, RUN_OVERRIDE] = Field(
        42, description="random seed for initialisation, data order and sampling",
    )
    save_path: OutputPath = Field(
        "./ckpt", description="output directory: HF model (safetensors + tokenizer) or report, and metrics.json",
    )
    bf16: bool = Field(False, description="compute in bfloat16 (otherwise fp32)")
    flash_attn: Annotated[bool, GpuOnly(False, "FlashAttention-2 has CUDA kernels only; attention runs with "
                                        "PyTorch's sdpa")] = Field(
        False, description="use FlashAttention-2 kernels (CUDA only)",
    )
    apply_chat_template: bool = Field(False, description="render prompts with the tokenizer's chat template")
    input_template: str | None = Field(
        None, description="template with {} for the prompt text, used without --apply_chat_template",
    )
    max_samples: Annotated[int, RUN_OVERRIDE] = _max_samples(1_000_000)
    use_tensorboard: Annotated[str | None, NOT_TRAINING] = Field(
        None, description="write metrics as TensorBoard events under this directory (one subdirectory per stage)",
    )
    use_wandb: Annotated[bool, NOT_TRAINING] = Field(
        False,
        description="log metrics to Weights & Biases: online with WANDB_API_KEY in the environment, otherwise "
        "offline run files (under $WANDB_DIR/wandb or <save_path>.wandb/wandb, beside the output, never in it) to "
        "upload later with `wandb sync`",
    )
    wandb_project: Annotated[str, NOT_TRAINING] = Field("rlhf-flow", description="W&B project of --use_wandb runs")
    wandb_run_name: Annotated[str | None, NOT_TRAINING] = Field(
        None, description="W&B run name of --use_wandb runs; unset: the stage name",
    )

    @model_validator(mode="after")
    def _reject_impossible(self) -> StageConfig:
        self._resolve()
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _resolve(self) -> None:
        """Fill values whose default depends on other fields."""

    def notes(self) -> list[str]:
        """Where these settings act otherwise than the same flags in OpenRLHF, and why: said once in the log."""
        return []

    def _problems(self) -> list[str]:
        problems = []
        if self.input_template is not None:
            if "{}" not in self.input_template:
                problems.append(f"--input_template {self.input_template!r} has no {{}} for the prompt")
            if self.apply_chat_template:
                problems.append("--input_template and --apply_chat_template exclude each other: pick one prompt format")
        return problems

    def missing_inputs(self) -> list[str]:
        """The required inputs this config leaves unset, as flags ("--a" or "--a or --b")."""
        return [
            " or ".join(f"--{name}" for name in group)
            for group in self.required_inputs
            if all(getattr(self, name) is None for name in group)
        ]


class TrainingConfig(StageConfig):
    """Runtime fields of every training stage: checkpoints, DeepSpeed, optimizer, batches."""

    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints")
    save_steps: Annotated[int, NOT_TRAINING, RUN_OVERRIDE] = Field(
        -1, ge=-1, description="optimizer steps between checkpoints; -1 = only the final output",
    )
    logging_steps: Annotated[int, NOT_TRAINING, RUN_OVERRIDE] = Field(
        1, ge=1, description="optimizer steps between metric log lines",
    )
    eval_steps: Annotated[int, NOT_TRAINING, RUN_OVERRIDE] = Field(
        -1, ge=-1, description="optimizer steps between evaluations; -1 = only the final evaluation",
    )
    max_ckpt_num: Annotated[int, NOT_TRAINING] = Field(
        3, ge=1, description="checkpoints kept under --ckpt_path; older ones are deleted",
    )
    load_checkpoint: Annotated[bool, NOT_TRAINING] = Field(
        False,
        description="resume from --ckpt_path even though its checkpoints were written by a run with other settings "
        "or data (a matching run resumes without it)",
    )
    zero_stage: int = Field(2, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3)")
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward to save memory")
    adam_offload: bool = Field(False, description="keep Adam optimizer states in CPU memory (needs ZeRO >= 1)")
    packing_samples: bool = Field(
        False,
        description="pack the samples of a micro-batch into one row without padding (position ids restart per "
        "sample, attention stays within each sample)",
    )
    ring_attn_size: int = Field(
        1, ge=1, description="ring attention: this many consecutive ranks split each packed micro-batch's tokens "
        "between them (the keys and values all-gathered in every attention layer), for sequences longer than one "
        "GPU holds; needs --packing_samples; must divide every model's ranks; 1 = off",
    )
    ring_head_stride: int = Field(
        1, ge=1, description="key/value heads ring attention gathers at a time (must divide the model's key/value "
        "heads): more is faster and takes more memory",
    )
    lr_warmup_ratio: float = Field(
        0.03, ge=0, le=1, description="fraction of the optimizer steps spent in linear warmup",
    )
    lr_scheduler: LRScheduler = Field("cosine_with_min_lr", description="learning-rate schedule after warmup")
    l2: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW beta1 and beta2")
    max_norm: float = Field(1.0, gt=0, description="gradient clipping: maximum global gradient norm")
    train_batch_size: int = Field(128, ge=1, description="samples per optimizer step, over all data-parallel ranks")
    micro_train_batch_size: int = _micro_train_batch_size(8)
    max_epochs: Annotated[int, RUN_OVERRIDE] = _max_epochs(1)
    max_len: int | None = _max_len(2048)
    eval_dataset: Annotated[str | None, Dataset(split="eval_split", held_out=True), NOT_TRAINING] = Field(
        None, description="held-out dataset: hub name, local json/jsonl/parquet or s3:// URI; a comma-separated list "
        "is read one after the other",
    )
    eval_split: Annotated[str, NOT_TRAINING] = _eval_split("test")
    lora_rank: int = Field(
        0, ge=0, description="train LoRA adapters (PEFT) of this rank instead of all weights; 0 = full fine-tuning",
    )
    lora_alpha: int = Field(
        16, ge=1, description="LoRA scaling: adapter updates are multiplied by lora_alpha / lora_rank",
    )
    target_modules: list[str] = Field(
        ["all-linear"],
        description="modules that get LoRA adapters: names such as q_proj v_proj, or all-linear (every linear layer "
        "but the output head)",
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the input of the LoRA adapters")
    load_in_4bit: bool = Field(
        False, description="QLoRA: load every model of the stage with 4-bit NF4 weights (bitsandbytes: double "
        "quantization, bfloat16 compute) and train LoRA adapters on them; needs --lora_rank, --bf16 and ZeRO 0-2",
    )

    def train_world_sizes(self) -> dict[str, int]:
        """Ranks of each trained model, keyed by the flags that set them (data-parallel: these / --ring_attn_size)."""
        raise NotImplementedError

    def model_world_sizes(self) -> dict[str, int]:
        """Ranks of every model the stage runs, keyed by the flags that set them (--ring_attn_size must divide them)."""
        return self.train_world_sizes()

    def _resolve(self) -> None:
        if self.packing_samples and "flash_attn" not in self.model_fields_set:
            # As OpenRLHF: packing turns FlashAttention on (its variable-length kernel keeps the packed sequences
            # apart); into __dict__, so that the field stays unset and notes() can tell.
            self.__dict__["flash_attn"] = True

    def notes(self) -> list[str]:
        if self.ring_attn_size > 1:
            return [f"--ring_attn_size {self.ring_attn_size}: attention is ring attention over torch's sdpa kernels "
                    "(keys and values all-gathered, a block-causal mask over each rank's share of the packed tokens)"
                    + ("; FlashAttention's kernels (--flash_attn) are not used for it" if self.flash_attn else "")]
        if self.packing_samples and "flash_attn" not in self.model_fields_set:
            return ["--packing_samples turns --flash_attn on, as in OpenRLHF"]
        if self.packing_samples and not self.flash_attn:
            return ["--packing_samples with --no_flash_attn: a packed micro-batch attends through a block mask over "
                    "all of its tokens (memory grows with their square)"]
        return []

    def _problems(self) -> list[str]:
        problems = super()._problems()
        for name in ("save_steps", "eval_steps"):
            if getattr(self, name) == 0:
                problems.append(f"--{name} 0 is not a step count: use -1 (only at the end) or a positive number")
        if self.adam_offload and self.zero_stage == 0:
            problems.append("--adam_offload needs --zero_stage 1, 2 or 3 (DeepSpeed offloads ZeRO optimizer states)")
        if not all(0 <= beta < 1 for beta in self.adam_betas):
            problems.append(f"--adam_betas {self.adam_betas[0]} {self.adam_betas[1]}: each must be in [0, 1)")
        if self.lora_rank == 0:
            unused = [f"--{name}" for name in ("lora_alpha", "target_modules", "lora_dropout")
                      if getattr(self, name) != type(self).model_fields[name].get_default(call_default_factory=True)]
            if unused:
                problems.append(f"{', '.join(unused)}: configures LoRA adapters, which are off; set --lora_rank > 0")
        elif not self.target_modules:
            problems.append("--target_modules is empty: name the modules that get LoRA adapters, or all-linear")
        if self.load_in_4bit:
            if self.lora_rank == 0:
                problems.append("--load_in_4bit: 4-bit weights cannot be trained; train LoRA adapters on them with "
                                "--lora_rank > 0")
            if not self.bf16:
                problems.append("--load_in_4bit computes in bfloat16 (as in OpenRLHF): add --bf16")
            if self.zero_stage == 3:
                problems.append("--load_in_4bit with --zero_stage 3: ZeRO-3 would partition the packed 4-bit weights "
                                "apart from their quantization state; use --zero_stage 2 (LoRA's optimizer states "
                                "are small)")
        if self.ring_attn_size > 1 and not self.packing_samples:
            problems.append(f"--ring_attn_size {self.ring_attn_size} splits packed micro-batches: add "
                            "--packing_samples (as OpenRLHF requires)")
        if self.ring_head_stride != 1 and self.ring_attn_size == 1:
            problems.append("--ring_head_stride configures ring attention, which is off: set --ring_attn_size > 1")
        for ranks_flags, ranks in self.model_world_sizes().items():
            if ranks % self.ring_attn_size:
                problems.append(f"--ring_attn_size {self.ring_attn_size} does not divide the {ranks} ranks of "
                                f"{ranks_flags}")
        for ranks_flags, ranks in self.train_world_sizes().items():
            if ranks % self.ring_attn_size:
                continue  # said above
            ranks //= self.ring_attn_size
            if getattr(self, "use_dynamic_batch", False):  # micro-batches by tokens: each rank an equal share
                if self.train_batch_size % ranks:
                    problems.append(f"--train_batch_size {self.train_batch_size} is not a multiple of the {ranks} "
                                    f"data-parallel ranks ({ranks_flags})")
            elif self.train_batch_size % (self.micro_train_batch_size * ranks):
                problems.append(
                    f"--train_batch_size {self.train_batch_size} is not a multiple of --micro_train_batch_size "
                    f"{self.micro_train_batch_size} × {ranks} data-parallel ranks ({ranks_flags})"
                )
        return problems


class RankLayout(StrictModel):
    """Ranks of a stage that runs one group of identical ranks: num_nodes × num_gpus_per_node."""

    num_nodes: int = Field(1, ge=1, description="nodes to run on")
    num_gpus_per_node: int = Field(8, ge=1, description="ranks per node (GPUs; CPU processes with --device cpu)")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


class OfflineTrainingConfig(RankLayout, TrainingConfig):
    """Training on a fixed dataset (SFT, reward model, DPO, KTO)."""

    required_inputs = (("pretrain",), ("dataset",))

    local_rank: Annotated[int, LAUNCHER] = Field(
        -1, description="rank on this node, passed by the deepspeed launcher (--local_rank=N)",
    )
    dataset: Annotated[str | None, Dataset(split="dataset_split")] = Field(
        None, description="training dataset: hub name, local json/jsonl/parquet or s3:// URI; a comma-separated list "
        "mixes several (see --dataset_probs)",
    )
    dataset_split: str = Field("train", description="split of --dataset to read (a single file is the split itself)")
    dataset_probs: str | None = _mixture_probs("dataset")
    tokenizer_chat_template: str | None = Field(
        None,
        description="Jinja chat template that replaces the tokenizer's own for --apply_chat_template; the exported "
        "model's tokenizer carries it, so later stages render prompts the same way",
    )

    def train_world_sizes(self) -> dict[str, int]:
        return {f"--num_nodes {self.num_nodes} × --num_gpus_per_node {self.num_gpus_per_node}": self.world_size}

    @property
    def dataset_probabilities(self) -> list[float] | None:
        return parse_probabilities(self.dataset, self.dataset_probs, "dataset", "dataset_probs", [])

    def _problems(self) -> list[str]:
        problems = super()._problems()
        parse_probabilities(self.dataset, self.dataset_probs, "dataset", "dataset_probs", problems)
        if self.tokenizer_chat_template is not None:
            if not self.apply_chat_template:
                # OpenRLHF ignores the template then; a flag that does nothing is refused here.
                problems.append("--tokenizer_chat_template is used by --apply_chat_template, which is off")
            else:
                import jinja2
                from transformers.utils.chat_template_utils import _compile_jinja_template

                try:  # compiled as apply_chat_template compiles it
                    _compile_jinja_template(self.tokenizer_chat_template)
                except jinja2.TemplateSyntaxError as error:
                    problems.append(f"--tokenizer_chat_template is not a Jinja template: {error.message} "
                                    f"(line {error.lineno})")
        return problems


class SupervisedKeys(StrictModel):
    """Column names of prompt/response rows."""

    input_key: str = Field("input", description="dataset column holding the prompt (text or chat messages)")
    output_key: str = Field("output", description="dataset column holding the response")


class PreferenceKeys(StrictModel):
    """Column names of preference rows."""

    prompt_key: str | None = Field(
        None, description="dataset column holding the prompt; unset: chosen/rejected hold whole conversations",
    )
    chosen_key: str = Field("chosen", description="dataset column holding the preferred response")
    rejected_key: str = Field("rejected", description="dataset column holding the dispreferred response")


class RouterBalancing(StrictModel):
    """The load-balancing loss of mixture-of-experts routers (OpenRLHF's --aux_loss_coef; not KTO, as there)."""

    aux_loss_coef: float = Field(
        0.0, ge=0,
        description="weight of the mixture-of-experts load-balancing loss (the routers' aux loss, from each "
        "forward's router logits) added to the training loss, averaged over a step's micro-batches and ranks (RL: "
        "the actor's and the critic's); the trained models must be MoE models (output_router_logits in their "
        "config); 0 = off",
    )


class PromptConfig(StageConfig):
    """Prompts, reward sources and rollout engines: what the RL and evaluation stages generate with and score."""

    required_inputs = (("pretrain",), ("prompt_data",), ("reward_pretrain", "remote_rm_url", "agent_func_path"))

    prompt_data: Annotated[str | None, Dataset(split="prompt_split")] = Field(
        None, description="prompt dataset: hub name, local json/jsonl/parquet or s3:// URI; a comma-separated list "
        "mixes several (RL: see --prompt_data_probs)",
    )
    prompt_split: str = Field("train", description="split of --prompt_data to read (a single file is the split itself)")
    input_key: str = Field(
        "input", description="dataset column holding the prompt: text, or chat messages (needs --apply_chat_template)",
    )
    label_key: str | None = Field(None, description="dataset column holding the reference answer passed to reward_func")
    prompt_max_len: int = Field(
        1024, ge=1, description="maximum prompt tokens; longer prompts are dropped (and counted in the log)",
    )
    generate_max_len: int = Field(1024, ge=1, description="maximum new tokens per response")
    remote_rm_url: Annotated[str | None, REWARD_SOURCE] = Field(
        None,
        description="reward function: a python file defining reward_func(queries, prompts, labels), or an HTTP "
        "endpoint, or a comma-separated list of endpoints (load-balanced; a failed request is retried with backoff "
        "on the next one)",
    )
    remote_rm_timeout: float = Field(
        180.0, gt=0, description="seconds an HTTP reward request may take before it counts as failed and is retried",
    )
    remote_rm_auth_env: str | None = Field(
        None,
        description="name of an environment variable of the Ray nodes (named as a secret: *_TOKEN, *_KEY, ...) whose "
        "value is sent as the Authorization header to the HTTP reward endpoints, e.g. REWARD_API_TOKEN holding "
        "'Bearer <token>'; credentials in --remote_rm_url itself are refused",
    )
    agent_func_path: Annotated[str | None, REWARD_SOURCE] = Field(
        None,
        description="a Python file defining AgentExecutor (OpenRLHF's agent interface, stages/agents.py): episodes of "
        "model turns and environment feedback replace single responses, and the agent's step rewards replace "
        "--remote_rm_url",
    )
    agent_timeout: float = Field(
        60.0, gt=0,
        description="seconds one call into the agent's code (reset, step, or its own execute between two generate "
        "calls) may take before the stage stops (exit 2), naming the call and the prompt",
    )
    reward_pretrain: ScorerPath = Field(None, description="reward model (HF dir, hub name or s3:// URI)")
    value_head_prefix: str = Field(
        "score", pattern=r"^[A-Za-z_][\w.]*$",
        description="name of the value head's weights in the reward model (and a critic started from it), as "
        "OpenRLHF names it; a value_head_prefix in the model's config.json wins. A reward model without trained "
        "weights under that name is refused",
    )
    normalize_reward: bool = Field(
        False,
        description="standardise reward-model scores with the mean/std stored in the reward model's config.json "
        "(reward_mean/reward_std from stages.reward_model, or OpenRLHF's mean/std)",
    )
    micro_rollout_batch_size: int = Field(
        8, ge=1, description="samples per forward pass on one rank when scoring rollouts (log-probs, values, rewards)",
    )
    rollout_backend: Annotated[RolloutBackend, RUN_OVERRIDE] = Field(
        "auto", description="generation engine: vllm, hf (transformers generate), or auto (vllm when installed); a run "
        "may choose it (how answers are computed, not what is trained on)",
    )
    vllm_num_engines: int = Field(1, ge=1, description="rollout engines (vLLM, or HF generate with the hf backend)")
    vllm_tensor_parallel_size: int = Field(1, ge=1, description="GPUs per vLLM engine (tensor parallelism)")
    vllm_gpu_memory_utilization: float = Field(
        0.95, gt=0, le=1, description="fraction of GPU memory a vLLM engine may use",
    )
    enforce_eager: Annotated[bool, GpuOnly(True, "CUDA graphs exist on GPUs only; CPU engines always run eagerly")] = (
        Field(False, description="run vLLM without CUDA graphs (on CPU engines always run eagerly)"))
    enable_prefix_caching: bool = Field(
        False, description="let vLLM reuse the KV cache of shared prompt prefixes (the n samples of a prompt)",
    )
    eval_n_samples_per_prompt: int = Field(
        4, ge=0, description="held-out evaluation: samples per prompt at --eval_temperature for pass@n (0: greedy only)",
    )
    eval_temperature: float = Field(
        0.6, gt=0, description="held-out evaluation: sampling temperature of the pass@n samples",
    )

    @property
    def rollout_token_budget(self) -> int | None:
        """Tokens per micro-batch of the reward model's forwards; None: --micro_rollout_batch_size rows (RL's
        --use_dynamic_batch sets it)."""
        return None

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.agent_func_path:
            others = [f"--{flag}" for flag in ("remote_rm_url", "reward_pretrain") if getattr(self, flag)]
            if others:
                problems.append(f"--agent_func_path rewards the episodes itself: not with {' and '.join(others)} "
                                "(choose one reward source)")
        elif self.agent_timeout != type(self).model_fields["agent_timeout"].default:
            problems.append(f"--agent_timeout {self.agent_timeout:g} configures --agent_func_path, which is unset")
        if self.rollout_backend == "hf" and self.vllm_tensor_parallel_size > 1:
            problems.append(
                f"--vllm_tensor_parallel_size {self.vllm_tensor_parallel_size} needs --rollout_backend vllm or auto "
                "(an HF generate engine runs on one device)"
            )
        return problems


# ---------------------------------------------------------------- stages

class SFTConfig(SupervisedKeys, RouterBalancing, OfflineTrainingConfig):
    """Supervised fine-tuning: `python -m stages.sft`."""

    pretrain: BaseModelPath = Field(None, description="model to fine-tune (HF dir, hub name or s3:// URI)")
    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints_sft")
    learning_rate: float = _learning_rate(5e-6)
    max_epochs: Annotated[int, RUN_OVERRIDE] = _max_epochs(2)
    system_key: str | None = Field(
        None,
        description="dataset column holding a system prompt (OpenOrca's system_prompt), rendered as a system message "
        "before the prompt; empty values add none",
    )
    multiturn: bool = Field(
        False,
        description="--input_key holds whole conversations (lists of messages): loss on every assistant turn",
    )
    pretrain_mode: bool = Field(
        False, description="continued pre-training: loss on every token of the --input_key text, no response column",
    )

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.multiturn and self.pretrain_mode:
            problems.append("--multiturn and --pretrain_mode exclude each other: pick one loss mask")
        if self.multiturn and not self.apply_chat_template:
            problems.append("--multiturn needs --apply_chat_template (conversations are rendered by the chat template)")
        if self.system_key is not None:
            if self.multiturn or self.pretrain_mode:
                problems.append("--system_key applies to prompt/response rows: a conversation holds its own system "
                                "message, and --pretrain_mode has no prompt")
            elif not self.apply_chat_template:
                problems.append("--system_key needs --apply_chat_template (a system prompt is a chat message)")
        return problems


class RewardModelConfig(PreferenceKeys, RouterBalancing, OfflineTrainingConfig):
    """Reward model on preference pairs: `python -m stages.reward_model` (OpenRLHF's train_rm)."""

    pretrain: BaseModelPath = Field(None, description="model the reward model starts from, usually the SFT model")
    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints_rm")
    learning_rate: float = _learning_rate(9e-6)
    micro_train_batch_size: int = _micro_train_batch_size(1)
    max_len: int | None = _max_len(512)
    loss: Literal["sigmoid", "logexp"] = Field(
        "sigmoid", description="pairwise loss: sigmoid (-log σ(r_c - r_r)) or logexp (log(1 + exp(r_r - r_c)))",
    )
    margin_loss: bool = Field(False, description="subtract the dataset's margin column inside the pairwise loss")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.margin_loss and self.loss != "sigmoid":
            problems.append(f"--margin_loss needs --loss sigmoid (the {self.loss} loss has no margin term)")
        return problems


class DPOConfig(PreferenceKeys, RouterBalancing, OfflineTrainingConfig):
    """Direct preference optimisation (and IPO, cDPO): `python -m stages.dpo`."""

    pretrain: PolicyPath = Field(None, description="policy to train, usually the SFT model")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model; unset: a copy of --pretrain")
    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints_dpo")
    learning_rate: float = _learning_rate(1e-5)
    max_len: int | None = _max_len(512)
    beta: float = Field(0.1, gt=0, description="strength of the implicit KL constraint to the reference")
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cDPO: assumed probability that a preference label is flipped",
    )
    ipo: bool = Field(False, description="use the IPO loss instead of the DPO sigmoid loss")
    nll_loss_coef: float = Field(0.0, ge=0, description="weight of an NLL loss on the chosen response")
    ref_offload: Annotated[bool, GpuOnly(False, PARAMETERS_IN_HOST_MEMORY)] = Field(
        False, description="keep the reference model's ZeRO-3 partitions in host memory, fetched layer by layer for "
        "its forwards (needs --zero_stage 3)",
    )

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.ipo and self.label_smoothing > 0:
            problems.append("--label_smoothing applies to the DPO loss only; drop it or --ipo")
        if self.ref_offload and self.zero_stage != 3:
            problems.append(f"--ref_offload offloads ZeRO-3 partitions: it needs --zero_stage 3, got {self.zero_stage}")
        return problems


class KTOConfig(SupervisedKeys, PreferenceKeys, OfflineTrainingConfig):
    """Kahneman-Tversky optimisation on unpaired desirable/undesirable responses: `python -m stages.kto`.

    Rows are unpaired (--input_key, --output_key, --label_key) or, when the dataset has --chosen_key and
    --rejected_key columns, preference pairs that are split into one desirable and one undesirable row each.
    """

    pretrain: PolicyPath = Field(None, description="policy to train, usually the SFT model")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model; unset: a copy of --pretrain")
    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints_kto")
    learning_rate: float = _learning_rate(1e-5)
    label_key: str = Field("label", description="dataset column saying whether the response is desirable (bool)")
    beta: float = Field(0.01, gt=0, description="strength of the implicit KL constraint to the reference")
    desirable_loss_weight: float = Field(1.0, gt=0, description="loss weight of desirable samples")
    undesirable_loss_weight: float = Field(1.0, gt=0, description="loss weight of undesirable samples")

    def _problems(self) -> list[str]:
        problems = super()._problems()
        if self.micro_train_batch_size < 2:
            problems.append(
                "--micro_train_batch_size 1: KTO's KL reference point scores each prompt with another sample's "
                "response from the same micro-batch, so it needs at least 2"
            )
        return problems


class RLConfig(RouterBalancing, TrainingConfig, PromptConfig):
    """Online RL (PPO, GRPO, RLOO, REINFORCE++ ...) with Ray roles: `python -m stages.rl` (OpenRLHF's train_ppo_ray)."""

    pretrain: PolicyPath = Field(None, description="initial actor (policy)")
    ref_pretrain: PolicyPath = Field(None, description="frozen reference model for the KL term; unset: --pretrain")
    critic_pretrain: ScorerPath = Field(
        None, description="initial critic for gae; unset: --reward_pretrain, or --pretrain with --remote_rm_url",
    )
    ckpt_path: OutputPath = _ckpt_path("./ckpt/checkpoints_ppo_ray")
    prompt_data_probs: str | None = _mixture_probs("prompt_data")
    eval_split: Annotated[str, NOT_TRAINING] = _eval_split("train")
    max_len: int | None = Field(
        None, ge=2,
        description="prompt + response token budget: each response stops at max_len - prompt length (and at "
        "--generate_max_len); unset: --prompt_max_len + --generate_max_len",
    )
    max_samples: Annotated[int, RUN_OVERRIDE] = _max_samples(100_000_000)
    micro_train_batch_size: int = _micro_train_batch_size(4)

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
    policy_loss_type: Literal["ppo", "gspo"] = Field(
        "ppo", description="ppo: token ratios, loss averaged over the step's tokens; gspo: one ratio per sequence "
        "(exp of its mean token log-ratio), loss averaged per sequence then over the step's sequences",
    )
    entropy_loss_coef: float | None = Field(
        None, ge=0,
        description="subtract coef × token entropy from the actor loss; unset: entropy is not computed, 0: logged only",
    )
    freezing_actor_steps: int = Field(
        -1, ge=-1, description="train only the critic for the first N steps (critic warm-up, gae); -1 = never",
    )
    dynamic_filtering: bool = Field(
        False,
        description="DAPO dynamic sampling: drop prompt groups whose mean score lies outside "
        "--dynamic_filtering_reward_range (no learning signal) and sample further prompts until the rollout is full",
    )
    dynamic_filtering_reward_range: tuple[float, float] = Field(
        (0.0, 1.0), description="a group is kept when low < mean score of its samples < high",
    )
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
    vllm_generate_batch_size: int | None = Field(
        None, ge=1,
        description="prompts per generate call when a rollout needs new samples; above --rollout_batch_size "
        "(needs --async_train) the extra groups are kept for the following steps; unset: --rollout_batch_size",
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
    value_clip: float = Field(0.5, gt=0, description="critic value clip range")
    gamma: float = Field(1.0, gt=0, le=1, description="discount factor")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda")

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
    def queue_size(self) -> int:
        """Rollouts generated ahead of training: 0 for synchronous training."""
        return self.async_queue_size if self.async_train else 0

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


class EvaluateConfig(RankLayout, PromptConfig):
    """Held-out evaluation of a policy against its reference (and the production policy): `python -m stages.evaluate`.

    Every model answers the prompts through the rollout engines: greedy answers (accuracy with a reward function,
    mean reward-model score) and --eval_n_samples_per_prompt samples (pass@n); the policy's KL to the reference is
    estimated on its own samples. Writes metrics.json and samples.jsonl.
    """

    pretrain: PolicyPath = Field(None, description="policy to evaluate (HF dir, hub name or s3:// URI)")
    prompt_data: Annotated[str | None, Dataset(split="prompt_split", held_out=True)] = Field(
        None, description="held-out prompts: hub name, local json/jsonl/parquet or s3:// URI",
    )
    ref_pretrain: PolicyPath = Field(
        None, description="reference policy to compare with (KL, reward gain, accuracy); unset: no comparison",
    )
    production_pretrain: PolicyPath = Field(
        None, description="the policy in production, scored on the same prompts (production_* metrics); unset: none",
    )
    num_gpus_per_node: int = Field(
        8, ge=1, description="ranks per node of the reward model that scores responses (with --reward_pretrain)",
    )
    micro_rollout_batch_size: int = Field(16, ge=1, description="sequences per reward-model forward on one rank")


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "sft": SFTConfig,
    "reward_model": RewardModelConfig,
    "dpo": DPOConfig,
    "kto": KTOConfig,
    "rl": RLConfig,
    "evaluate": EvaluateConfig,
}
# The stages that train on a fixed dataset, as opposed to RL and the evaluation, which read prompts.
OFFLINE_STAGES = tuple(stage for stage, cls in STAGE_CONFIGS.items() if issubclass(cls, OfflineTrainingConfig))




# ---------------------------------------------------------------- presets

def preset_names() -> list[str]:
    return sorted(path.stem for path in CONFIG_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> Path:
    """configs/<name>.yaml next to this package for a preset name; otherwise the YAML file path itself."""
    if name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        return path
    path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name_or_path!r}: use one of {', '.join(preset_names())} or a YAML path")
    return path


def read_yaml_mapping(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def preset_sections(path: Path, data: dict) -> dict[str, dict]:
    """The stage sections of a preset's data, an empty one for each stage it leaves out (or sets to null)."""
    sections = {}
    for stage in STAGE_CONFIGS:
        section = data.get(stage)
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{path}: section {stage!r} must be a mapping of flag names to values")
        sections[stage] = section or {}
    return sections


def preset_data(path: Path) -> dict:
    """A preset file's mapping with its `extends:` resolved: the named preset's data (itself resolved), this file's
    keys merged over it, a stage section key by key."""
    return resolve_extends(read_yaml_mapping(path), str(path), ())


def resolve_extends(data: dict, where: str, chain: tuple[Path, ...] = ()) -> dict:
    """`data` without its `extends: <preset name or YAML path>`, merged over the preset it names. A preset that
    extends another names its own pipeline: with the base's name its runs would share the base's artifacts and
    production policy."""
    if data.get("extends") is None:  # none, or a config already resolved (dumped with `extends: null`)
        return data
    own = {key: value for key, value in data.items() if key != "extends"}
    base = data["extends"]
    if not isinstance(base, str) or not base:
        raise ConfigError(f"{where}: extends must name a preset ({', '.join(preset_names())}) or a YAML path")
    if "name" not in own:
        raise ConfigError(f"{where}: extends {base} but sets no name of its own: its runs would share {base}'s "
                          "artifacts and production policy")
    base_path = preset_path(base).resolve()
    if base_path in chain:
        raise ConfigError(f"{where}: extends {base}, which extends it back ({' -> '.join(p.stem for p in chain)})")
    return deep_merge(resolve_extends(read_yaml_mapping(base_path), str(base_path), (*chain, base_path)), own)


def deep_merge(base: dict, overrides: dict) -> dict:
    """`overrides` over `base`; nested mappings merge key by key."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def stage_values(name_or_path: str, stage: str) -> tuple[dict, str, str]:
    """(values, file, key prefix) of `stage` from --config: a preset's `stage:` section (with what it extends), or
    the whole file when it holds one stage's flags at the top level (no stage section in it)."""
    path = preset_path(name_or_path)
    data = preset_data(path)
    if data and not set(data) & set(STAGE_CONFIGS):
        return data, str(path), ""
    return preset_sections(path, data)[stage], str(path), f"{stage}."


def validation_messages(error: ValidationError, name_of: Callable[[tuple], str]) -> list[str]:
    """One line per validation error, naming the flag (or preset key) and the reason."""
    lines = []
    for item in error.errors():
        loc, message = item["loc"], item["msg"].removeprefix("Value error, ")
        if item["type"] == "value_error":  # raised by a model validator: the message names the flags
            lines.append(f"{name_of(loc)}: {message}" if loc else message)
        elif item["type"] == "extra_forbidden":
            lines.append(f"unknown field {name_of(loc)}")
        else:
            lines.append(f"invalid value for {name_of(loc)}: {message}")
    return lines
