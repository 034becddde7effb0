"""DeepSpeed plumbing shared by the training stages: engine creation, checkpoints, HF export, step schedules.

Kept apart from the math (stages/algorithms.py) and from Ray (stages/distributed.py).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from stages.errors import StageInputError
from stages.fields import Dataset, Launcher, NotTraining, Output, fields_with, names_with
from stages.lean_imports import lean_transformers


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors, ints and strings only: what `torch.load(weights_only=True)` reads, so
    that loading a checkpoint never unpickles objects (a planted file could run code)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                      "has_gauss": int(has_gauss), "cached_gauss": float(cached_gauss)},
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss"]))
    np.random.set_state((numpy_state["kind"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["position"],
                         numpy_state["has_gauss"], numpy_state["cached_gauss"]))
    torch.set_rng_state(state["torch"])


def deepspeed_config(cfg, *, world_size: int, train_batch_size: int, micro_batch_size: int,
                     zero_stage: int | None = None, train: bool = True, offload_params: bool = False) -> dict:
    """The DeepSpeed config for one model role. `train_batch_size` counts samples per optimizer step;
    `offload_params` keeps a frozen model's ZeRO-3 partitions in host memory (--ref_reward_offload, --ref_offload).

    With --ring_attn_size the `world_size` ranks form world_size / ring data-parallel groups: the accumulation
    count follows those, and DeepSpeed, which counts every rank as data-parallel, is told ring times the batch."""
    stage = cfg.zero_stage if zero_stage is None else zero_stage
    ring = getattr(cfg, "ring_attn_size", 1)
    data_parallel = world_size // ring
    if train and getattr(cfg, "use_dynamic_batch", False):
        # Micro-batches by token budget, a varying number per optimizer step: no fixed accumulation count, the
        # trainer marks each step's last micro-batch (stages/rl/actor.py, accumulate).
        micro_batch_size, train_batch_size = 1, data_parallel
    zero: dict[str, Any] = {"stage": stage}
    if train and getattr(cfg, "adam_offload", False):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    accumulation = train_batch_size // (micro_batch_size * data_parallel)
    if accumulation < 1 or accumulation * micro_batch_size * data_parallel != train_batch_size:
        raise ValueError(
            f"train_batch_size={train_batch_size} must be a multiple of micro_train_batch_size={micro_batch_size}"
            f" x {data_parallel} data-parallel ranks"
        )
    return {
        "train_batch_size": train_batch_size * ring,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": cfg.max_norm if train else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bool(cfg.bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


def load_for_zero(load_fn, ds_config: dict):
    """Load a HF model so that ZeRO-3 partitions it while loading (HfDeepSpeedConfig must be alive then)."""
    if ds_config["zero_optimization"]["stage"] != 3:
        return load_fn()
    from transformers.integrations import HfDeepSpeedConfig

    hf_ds_config = HfDeepSpeedConfig(ds_config)
    try:
        return load_fn()
    finally:
        # A live HfDeepSpeedConfig makes later single-rank loads hang: drop it right away.
        del hf_ds_config


def trained_model(model: torch.nn.Module, cfg, *, init: str, value_model: bool, aux_loss_coef: float
                  ) -> torch.nn.Module:
    """A loaded model made trainable the same way in every training stage and RL role: its routers checked against
    --aux_loss_coef (a model without a load-balancing loss is refused, naming `init`), then LoRA adapters with
    --lora_rank (`value_model`: the value head trains whole)."""
    from stages import lora, moe

    moe.check_router(model, aux_loss_coef, init)
    return lora.wrap(model, cfg, value_model=value_model)


ADAM_EPS = 1e-8  # torch.optim.AdamW's and DeepSpeed's FusedAdam / DeepSpeedCPUAdam's default alike


def optimizer_section(cfg, *, learning_rate: float, device: str) -> dict | None:
    """The DeepSpeed config's "optimizer" section for a trained model on `device` (DeepSpeed's accelerator: "cuda"
    or "cpu"), or None where the engine gets an optimizer instance.

    On GPUs DeepSpeed builds the optimizer from the section: FusedAdam (in AdamW mode), or DeepSpeedCPUAdam when
    --adam_offload moves the optimizer to host memory (engine.py get_optimizer_configuration). ZeRO-3's
    offload_states (--deepspeed_enable_sleep) accepts FusedAdam only (deepspeed/runtime/zero/stage3.py:3869, "Offloading
    is supported only for DeepSpeed FusedAdam."), which an optimizer instance built here would not be. On CPU
    FusedAdam has no kernel: the engine keeps torch's AdamW (or DeepSpeedCPUAdam with --adam_offload) as an instance,
    as before."""
    if device != "cuda":
        return None
    return {"type": "AdamW", "params": {"lr": learning_rate, "betas": list(cfg.adam_betas), "eps": ADAM_EPS,
                                        "weight_decay": cfg.l2}}


def jit_arch_list(value: str) -> str | None:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT build of FusedAdam can read it, or None where it reads it already.
    DeepSpeed 0.19 parses each entry's parts as integers (op_builder/builder.py compute_capability_args), so an
    arch-specific entry such as Hopper's `9.0a`, which CUDA images set, fails the build with "invalid literal for
    int(): '0a'" (seen on an H200). The suffix is dropped: FusedAdam uses no arch-specific instruction."""
    entries = [entry.strip() for entry in value.replace(" ", ";").split(";") if entry.strip()]
    readable = [re.sub(r"(?<=\d)[a-z]+(?=(\+PTX)?$)", "", entry) for entry in entries]
    return ";".join(readable) if readable != entries else None


def build_train_engine(model: torch.nn.Module, cfg, ds_config: dict, *, learning_rate: float, total_steps: int):
    """A DeepSpeed engine with AdamW (CPU Adam when the optimizer is offloaded) and the configured LR schedule; on
    GPUs DeepSpeed builds the optimizer from its config (optimizer_section)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    lean_transformers()
    from transformers import get_scheduler

    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]

    def schedule(optimizer):
        return get_scheduler(
            cfg.lr_scheduler,
            optimizer,
            num_warmup_steps=int(cfg.lr_warmup_ratio * total_steps),
            num_training_steps=max(total_steps, 1),
            # As OpenRLHF: the cosine schedule decays to a tenth of the peak rate.
            scheduler_specific_kwargs={"min_lr": learning_rate * 0.1} if cfg.lr_scheduler == "cosine_with_min_lr"
            else None,
        )

    section = optimizer_section(cfg, learning_rate=learning_rate, device=get_accelerator().device_name())
    if section is not None:
        if (readable := jit_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST", ""))) is not None:
            print(f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']} read as {readable} for DeepSpeed's "
                  "build of FusedAdam, which cannot parse arch-specific entries", flush=True)
            os.environ["TORCH_CUDA_ARCH_LIST"] = readable
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, lr_scheduler=schedule,
                                          config={**ds_config, "optimizer": section})
        return engine
    betas = tuple(cfg.adam_betas)
    if getattr(cfg, "adam_offload", False):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=learning_rate, betas=betas, weight_decay=cfg.l2)
    else:
        optimizer = torch.optim.AdamW(params, lr=learning_rate, betas=betas, weight_decay=cfg.l2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=schedule(optimizer),
                                      config=ds_config)
    return engine


def offload_training_states(engine) -> None:
    """--deepspeed_enable_sleep (GPUs, ZeRO-3): the optimizer states, fp32 master weights and gradient buffers go to
    host memory until `engine.reload_states()`. The bf16 working weights stay: log-probs and values are computed
    between training phases."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                                   OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer])
    torch.cuda.empty_cache()


def build_inference_engine(model: torch.nn.Module, ds_config: dict, device: str):
    """A frozen model (reference, reward) wrapped by DeepSpeed only for ZeRO-3 sharding; plain module otherwise."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] != 3:
        return model.to(device)
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.eval()
    return engine


def global_loss_scale(engine, ring_size: int = 1) -> float:
    """Factor that turns a per-micro-batch `sum / step_tokens` into a global token mean after DeepSpeed divides
    by gradient accumulation steps and averages gradients over all ranks. The ranks of a ring (--ring_attn_size)
    compute one loss between them, each with `ring_size` times its share of the gradient
    (stages/ring_attention.py): the mean counts data-parallel groups."""
    return float(engine.gradient_accumulation_steps() * engine.world_size // ring_size)


# ---------------------------------------------------------------- checkpoints
#
# <ckpt_path>/step00000050/<tag>/   one DeepSpeed checkpoint per trained model (tag "model", or "actor"/"critic")
#                                    with every rank's RNG state beside it, and SHA256SUMS.rank<r>.json: the sha256 of
#                                    each file DeepSpeed may unpickle (its loads use torch.load(weights_only=False)),
#                                    checked before it loads any, with what each file's pickle would construct
# <ckpt_path>/latest_step.json      the newest complete step, written last (a crash mid-save leaves the previous one)
# <ckpt_path>/fingerprint.json      what the checkpoints trained: stage, config fields that change training, the
#                                    content of its datasets; a run that does not match may not resume from them

def write_replacing(path: Path, text: str) -> None:
    """`text` as `path`, whole or not at all: written to a temporary file of a fresh name, created exclusively
    (the workspace is shared with every job of the stage key: a file or symlink planted at a predictable temporary
    name is never written through), then renamed over `path` (a symlink there is replaced, not followed)."""
    descriptor, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


LATEST_MARKER = "latest_step.json"
FINGERPRINT_FILE = "fingerprint.json"
CHECKSUMS_GLOB = "SHA256SUMS.rank*.json"
# Files of a checkpoint this project reads itself with torch.load(weights_only=True): no code runs from them.
READ_WEIGHTS_ONLY = ("rng_rank*.pt", "ema.pt")
# What DeepSpeed's checkpoints pickle beyond torch's weights-only allow-list (read from the states files of every
# ZeRO stage and dtype it writes): plain data. Anything else in a states file is refused before DeepSpeed loads it.
DEEPSPEED_PICKLED = frozenset({"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                               "deepspeed.runtime.zero.config.ZeroStageEnum",
                               "deepspeed.utils.tensor_fragment.fragment_address"})


class NonFiniteLossError(StageInputError):
    """Training diverged: a step's loss or gradient norm is nan or inf. A retry diverges again (exit code 2)."""


def stop_if_diverged(record: dict[str, Any], step: int, keys: tuple[str, ...], ckpt_path: str | None) -> None:
    """Raise NonFiniteLossError when one of `keys` in a step's `record` (losses, KL, gradient norms) is nan or inf.

    Every rank of a stage sees the same values (summed or reduced over all of them) and stops at the same step.
    A gradient norm counts too: ZeRO-1/2/3 skip such steps silently and report a finite loss while the model
    stops learning. Nothing of the step is saved, so the newest checkpoint is the last good one."""
    bad = {key: record[key] for key in keys if record.get(key) is not None and not math.isfinite(record[key])}
    if not bad:
        return
    last = latest_checkpoint_step(ckpt_path) if ckpt_path else 0
    kept = (f"the newest checkpoint, step {last}, is kept in {ckpt_path}" if last else "no checkpoint was saved")
    raise NonFiniteLossError(
        f"step {step}: {', '.join(f'{key}={value}' for key, value in bad.items())} is not finite: training diverged "
        f"(lower the learning rate, or check the data or rewards of that step); nothing of step {step} was saved, "
        f"{kept}")


def step_dir(ckpt_dir: str | os.PathLike, step: int) -> Path:
    return Path(ckpt_dir) / f"step{step:08d}"


def latest_checkpoint_step(ckpt_dir: str | os.PathLike) -> int:
    """Step of the newest complete checkpoint under ckpt_dir (0 when there is none)."""
    marker = Path(ckpt_dir) / LATEST_MARKER
    if not marker.exists():
        return 0
    return int(json.loads(marker.read_text())["step"])


def training_fingerprint(stage: str, cfg) -> dict[str, Any]:
    """What a run trains: its stage, every config field that changes training (not outputs, logging, evaluation,
    checkpoint cadence or the resume switch: stages/fields.py), and the contents of the datasets it trains on."""
    values = cfg.model_dump(mode="json")
    ignored = names_with(type(cfg), NotTraining, Output, Launcher)
    data = {field: _content(values[field]) for field in fields_with(type(cfg), Dataset)
            if field not in ignored and values.get(field)}
    config = {key: value for key, value in values.items() if key not in ignored}
    return {"stage": stage, "config": config, "data": data}


def _content(source: str) -> str:
    """A dataset's fingerprint for checkpoint ownership; a hub dataset whose revision cannot be told here (a run by
    hand offline, from the local hub cache) by its name."""
    from stages.fingerprint import HubUnavailable, dataset_fingerprint

    try:
        return dataset_fingerprint(source)
    except HubUnavailable:
        return f"hub:{source}@unknown"


def _fingerprint_differences(old: dict, new: dict) -> list[str]:
    differences = []
    if old.get("stage") != new["stage"]:
        differences.append(f"stage {old.get('stage')!r} -> {new['stage']!r}")
    for key in sorted(set(old.get("config", {})) | set(new["config"])):
        before, after = old.get("config", {}).get(key), new["config"].get(key)
        if before != after:
            differences.append(f"--{key} {before!r} -> {after!r}")
    for key in sorted(set(old.get("data", {})) | set(new["data"])):
        before, after = old.get("data", {}).get(key), new["data"].get(key)
        if before != after:
            differences.append(f"content of --{key} ({before} -> {after})")
    return differences


def claim_checkpoints(stage: str, cfg, *, write: bool = True) -> int:
    """Decide, before any rank starts, whether this run resumes from --ckpt_path: returns the step to resume from.

    A fresh directory (no complete checkpoint) is claimed by writing this run's fingerprint. Checkpoints written
    by a run with another fingerprint are refused (StageInputError naming what differs) unless --load_checkpoint
    asks to resume from them anyway; then the directory is claimed by this run. Under a launcher every rank
    checks; only the one with `write` claims.
    """
    ckpt_dir = Path(cfg.ckpt_path)
    fingerprint = training_fingerprint(stage, cfg)
    step = latest_checkpoint_step(ckpt_dir)
    if step:
        path = ckpt_dir / FINGERPRINT_FILE
        old = json.loads(path.read_text()) if path.exists() else {}
        differences = _fingerprint_differences(old, fingerprint) if old else ["no fingerprint.json (written by "
                                                                            "another program or an older version)"]
        if differences and not cfg.load_checkpoint:
            raise StageInputError(
                f"--ckpt_path {ckpt_dir} holds checkpoints (step {step}) of another run: "
                + "; ".join(differences)
                + ". Start fresh with another --ckpt_path (or delete that directory), or resume from these "
                "checkpoints anyway with --load_checkpoint."
            )
        if not differences:
            return step
        print(f"[{stage}] --load_checkpoint: resuming from step {step} of a run that differed: "
              + "; ".join(differences), flush=True)
    if not write:
        return step
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_replacing(ckpt_dir / FINGERPRINT_FILE, json.dumps(fingerprint, indent=1, sort_keys=True))
    return step


def save_checkpoint(engine, ckpt_dir: str | os.PathLike, step: int, client_state: dict, tag: str = "model") -> None:
    """Save one model's engine (weights, optimizer, scheduler) plus client state and every rank's RNG state.

    All ranks of the model call it; the checkpoint counts only once `commit_checkpoint` has marked its step.
    """
    directory = step_dir(ckpt_dir, step)
    engine.save_checkpoint(str(directory), tag=tag, client_state=client_state)
    torch.save(rng_state(), directory / tag / f"rng_rank{dist.get_rank()}.pt")
    dist.barrier()
    _record_checksums(directory / tag)


def _unpickled_files(folder: Path) -> list[str]:
    """The files of a model's checkpoint folder that DeepSpeed may unpickle, relative and sorted."""
    return sorted(path.relative_to(folder).as_posix() for path in folder.rglob("*") if path.is_file()
                  and not path.match(CHECKSUMS_GLOB) and not any(path.match(name) for name in READ_WEIGHTS_ONLY))


def _sha256(path: Path) -> str:
    import hashlib

    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _record_checksums(folder: Path) -> None:
    """Each rank hashes its share of the checkpoint's files (round robin), so that 8 ranks hash an 8B model's
    optimizer states in an eighth of the time, and writes them as SHA256SUMS.rank<r>.json."""
    rank, world = dist.get_rank(), dist.get_world_size()
    files = _unpickled_files(folder)
    dist.barrier()  # every rank has listed the folder before any writes its temporary sums file into it
    sums = {rel: _sha256(folder / rel) for i, rel in enumerate(files) if i % world == rank}
    write_replacing(folder / f"SHA256SUMS.rank{rank}.json", json.dumps(sums, indent=0))
    dist.barrier()


def _code_in_pickle(path: Path) -> str | None:
    """What in the torch.save file at `path` a weights-only load would refuse (a global outside torch's allow-list
    and DEEPSPEED_PICKLED, an opcode it does not take, not a torch.save file), read from its pickle's opcodes without
    running them; None when nothing."""
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path)) - DEEPSPEED_PICKLED
    except Exception as error:  # noqa: BLE001 - torch raises several kinds for a file that is not its format
        return f"not a checkpoint a weights-only load reads ({type(error).__name__}: {str(error)[:200]})"
    return f"its pickle constructs {', '.join(sorted(unsafe))}, which could run code" if unsafe else None


def _verify_checksums(folder: Path) -> None:
    """Before DeepSpeed unpickles anything: the folder holds exactly the files the checksums list, each with its
    recorded sha256, and no file's pickle names anything but tensors and the plain data DeepSpeed writes
    (DEEPSPEED_PICKLED); every rank checks its share, then all learn what any found. The sums find damage; the
    pickle check stands between a file planted in the workspace (which every run of the stage key shares, and
    whose sums a planter could rewrite) and the code it would run on resume."""
    rank, world = dist.get_rank(), dist.get_world_size()
    recorded: dict[str, str] = {}
    problems: list[str] = []
    for path in sorted(folder.glob(CHECKSUMS_GLOB)):
        try:
            recorded.update(json.loads(path.read_text()))
        except ValueError as error:
            problems.append(f"{path.name} unreadable ({error})")
    files = _unpickled_files(folder)
    if not recorded and not problems:
        problems.append("no checksums (written by an older version, or not by this project)")
    else:
        problems += [f"{rel}: not in the checksums" for rel in sorted(set(files) - set(recorded))]
        problems += [f"{rel}: missing" for rel in sorted(set(recorded) - set(files))]
        problems += [f"{rel}: sha256 differs from the one recorded when it was written" for i, rel in enumerate(files)
                     if i % world == rank and rel in recorded and _sha256(folder / rel) != recorded[rel]]
    problems += [f"{rel}: {code}" for i, rel in enumerate(files)
                 if i % world == rank and (code := _code_in_pickle(folder / rel)) is not None]
    found: list[list[str]] = [[] for _ in range(world)]
    dist.all_gather_object(found, problems)
    problems = sorted({problem for share in found for problem in share})
    if problems:
        raise StageInputError(f"checkpoint {folder} is not as written, nothing of it was loaded: {'; '.join(problems)}"
                              "; resume from another --ckpt_path or start fresh")


def commit_checkpoint(ckpt_dir: str | os.PathLike, step: int, max_keep: int) -> None:
    """Mark `step` as the newest complete checkpoint (after every model saved it), then drop the oldest ones.

    Called once (rank 0, or the RL driver).
    """
    ckpt_dir = Path(ckpt_dir)
    write_replacing(ckpt_dir / LATEST_MARKER, json.dumps({"step": step}))
    current = step_dir(ckpt_dir, step)
    old = sorted(p for p in ckpt_dir.glob("step*") if p.is_dir() and p != current)
    for path in old[: max(0, len(old) - (max_keep - 1))]:
        shutil.rmtree(path, ignore_errors=True)


def load_checkpoint(engine, ckpt_dir: str | os.PathLike, step: int, tag: str = "model") -> dict:
    """Restore one model's engine and this rank's RNG state from `step`; returns the client state."""
    directory = step_dir(ckpt_dir, step)
    _verify_checksums(directory / tag)
    _, client_state = engine.load_checkpoint(str(directory), tag=tag)
    set_rng_state(load_rng_state(directory / tag / f"rng_rank{dist.get_rank()}.pt"))
    return client_state or {}


def load_rng_state(path: Path) -> dict[str, Any]:
    """A saved RNG state, read with `weights_only=True`: tensors and plain values, never an object to unpickle."""
    import pickle

    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as error:
        raise StageInputError(f"{path}: not an RNG state this project writes (it holds objects torch.load with "
                              f"weights_only refuses: {str(error).splitlines()[0]}); resume from another "
                              "--ckpt_path or start fresh") from None


def export_hf(engine_or_model, tokenizer, out_dir: str | os.PathLike, extra_config: dict | None = None) -> None:
    """Write the model in HF format (safetensors + tokenizer) from rank 0; all ranks must call (ZeRO-3 gathers).

    A LoRA model is written merged (loadable like any HF model) with its adapter in `<out_dir>/lora_adapter`. Only
    rank 0 copies the weights to host memory; the others walk them on the meta device, joining the gathers.
    """
    from stages import lora

    state = dict(lora.merged_named_weights(engine_or_model, device="cpu" if dist.get_rank() == 0 else "meta"))
    adapter = lora.adapter_state(engine_or_model) if lora.is_lora(engine_or_model) else None
    if dist.get_rank() == 0:
        from stages.model_io import save_hf

        save_hf(lora.hf_model(engine_or_model), tokenizer, out_dir, extra_config, state)
        if adapter is not None:
            lora.save_adapter(engine_or_model, Path(out_dir) / lora.ADAPTER_DIR, adapter)
    dist.barrier()


def write_metrics(save_path: str | os.PathLike, metrics: dict) -> None:
    path = Path(save_path)
    path.mkdir(parents=True, exist_ok=True)
    write_replacing(path / "metrics.json", json.dumps(metrics, indent=2, sort_keys=True))

