"""What every stage's config is made of, and the presets configs are read from.

Each stage's own config class is its package's config.py (stages/sft/config.py, stages/rl/config.py, ...), built
from the base classes and field groups here; field names are OpenRLHF's flag names, so its commands run with our
module paths (stages/cli.py builds the flags):

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator

from infra.secrets import url_credentials_refusal
from stages.fields import (
    LAUNCHER, NOT_TRAINING, OUTPUT, REWARD_SOURCE, RUN_OVERRIDE, RUN_OVERRIDE_KEEPING_CHECKPOINTS, Dataset, FileValued,
    GpuOnly, ModelPath, fields_with, files_may_be_read,
)  # fmt: skip
from stages.fingerprint import mixture_parts

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"

Device = Literal["auto", "cpu", "cuda"]
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
    # Validation errors never repeat the input: a config holds URLs and paths that may carry credentials, and the
    # errors reach logs, flow run states and the UI.
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)

    @model_validator(mode="before")
    @classmethod
    def _no_file_read_for_parameters(cls, data, info: ValidationInfo):
        # Before any field's own validator may open the file a string names (stages/fields.py, FileValued): a run's
        # parameters on the worker would otherwise have its files read (quoted in errors, /dev/zero, FIFOs).
        if not isinstance(data, dict) or files_may_be_read(info):
            return data
        for name, role in fields_with(cls, FileValued).items():
            value = data.get(name)
            if isinstance(value, str) and value not in role.installed():
                raise ValueError(f"{name} is a string, which would name a file to read: the config of a run holds "
                                 f"values only{_installed_names(role)}; files are read only from a preset, a "
                                 "--config file or a command line")
        return data


def _installed_names(role: FileValued) -> str:
    names = role.installed()
    return f" (or one of the install's {', '.join(names)})" if names else ""


# ---------------------------------------------------------------- fields repeated with stage-specific defaults

def learning_rate_field(default: float) -> Any:
    return Field(default, gt=0, description="peak learning rate of the AdamW optimizer")


def ckpt_path_field(default: str) -> Any:
    return Field(default, description="directory for resumable checkpoints; a restarted stage resumes from the newest")


def micro_train_batch_size_field(default: int) -> Any:
    return Field(default, ge=1, description="samples per forward/backward pass on one rank")


def max_epochs_field(default: int) -> Any:
    return Field(default, ge=1, description="passes over the training data (RL: over each rollout batch)")


def max_len_field(default: int | None) -> Any:
    return Field(default, ge=1, description="maximum tokens per sample (prompt + response); longer ones are truncated")


def max_samples_field(default: int) -> Any:
    return Field(default, ge=1, description="use at most this many rows of each dataset")


def eval_split_field(default: str) -> Any:
    return Field(default, description="split of --eval_dataset to read (a single file is the split itself)")


def mixture_probs_field(sources_flag: str) -> Any:
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

# The stages, in pipeline order. Each is a package stages/<name>/ whose config.py defines its config class and whose
# __main__.py is its entrypoint (`python -m stages.<name>`); stages/registry.py maps the names to the classes.
STAGE_NAMES = ("sft", "reward_model", "dpo", "kto", "rl", "evaluate")


class StageConfig(StrictModel):
    """Fields every stage has, and the hook that rejects impossible combinations."""

    # What the stage is, for the pipeline, the plan and the rehearsal (each stage's config class is its descriptor):
    # its name (its package stages/<stage>/, its section in presets, its pipeline step),
    stage: ClassVar[str]
    # whether its output is a candidate policy (the one the evaluation judges and the gate promotes),
    trains_policy: ClassVar[bool] = False
    # the tiny task's rows (stages.tiny.DATASET_FILES) its datasets hold in a rehearsal,
    tiny_rows: ClassVar[str]
    # its fields the tiny assets fill when a pipeline with tiny_assets_dir leaves them unset and no stage feeds
    # them (the asset names of stages.tiny; "rule_reward" is the tiny task's reward function),
    tiny_assets: ClassVar[dict[str, str]] = {}
    # and the flags that set how many bundles it asks of the cluster, named when they do not fit.
    rank_flags: ClassVar[str] = "num_nodes × num_gpus_per_node"
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
    max_samples: Annotated[int, RUN_OVERRIDE] = max_samples_field(1_000_000)
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

    ckpt_path: OutputPath = ckpt_path_field("./ckpt/checkpoints")
    save_steps: Annotated[int, NOT_TRAINING, RUN_OVERRIDE_KEEPING_CHECKPOINTS] = Field(
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
    micro_train_batch_size: int = micro_train_batch_size_field(8)
    max_epochs: Annotated[int, RUN_OVERRIDE] = max_epochs_field(1)
    max_len: int | None = max_len_field(2048)
    eval_dataset: Annotated[str | None, Dataset(split="eval_split", held_out=True), NOT_TRAINING] = Field(
        None, description="held-out dataset: hub name, local json/jsonl/parquet or s3:// URI; a comma-separated list "
        "is read one after the other",
    )
    eval_split: Annotated[str, NOT_TRAINING] = eval_split_field("test")
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
    dataset_probs: str | None = mixture_probs_field("dataset")
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
        description="a Python file defining AgentExecutor (OpenRLHF's agent interface, stages/rl/agents.py): episodes of "
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

    def validate_rows(self, rows, source: str) -> None:
        """The prompt schema check (the stage's and the plan's): exit 2 naming the row."""
        from stages import data

        data.validate_prompt_rows(self, rows, source)

    @property
    def rollout_token_budget(self) -> int | None:
        """Tokens per micro-batch of the reward model's forwards; None: --micro_rollout_batch_size rows (RL's
        --use_dynamic_batch sets it)."""
        return None

    def _problems(self) -> list[str]:
        problems = super()._problems()
        # Refused with the config, before the stage writes anything (its checkpoint fingerprint holds the config).
        if self.remote_rm_url and (refusal := url_credentials_refusal("--remote_rm_url", self.remote_rm_url)):
            problems.append(refusal)
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


# ---------------------------------------------------------------- presets


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
    for stage in STAGE_NAMES:
        section = data.get(stage)
        if section is not None and not isinstance(section, dict):
            raise ConfigError(f"{path}: section {stage!r} must be a mapping of flag names to values")
        sections[stage] = section or {}
    return sections


def preset_data(path: Path) -> dict:
    """A preset file's mapping with its `extends:` resolved: the named preset's data (itself resolved), this file's
    keys merged over it, a stage section key by key."""
    return resolve_extends(read_yaml_mapping(path), str(path), ())


def resolve_extends(data: dict, where: str, chain: tuple[Path, ...] = (), presets_only: bool = False) -> dict:
    """`data` without its `extends: <preset name or YAML path>`, merged over the preset it names. A preset that
    extends another names its own pipeline: with the base's name its runs would share the base's artifacts and
    production policy. `presets_only`: `data` came as a parameter (a deployment run's `config`), which may extend
    a preset of the install by name but never have a file of the machine read."""
    if data.get("extends") is None:  # none, or a config already resolved (dumped with `extends: null`)
        return data
    own = {key: value for key, value in data.items() if key != "extends"}
    base = data["extends"]
    if presets_only and base not in preset_names():
        raise ConfigError(f"{where}: extends may name only a preset ({', '.join(preset_names())}) here, not a file: "
                          "a run's parameters never have files read")
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
    if data and not set(data) & set(STAGE_NAMES):
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
