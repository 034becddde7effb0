"""What a stage reports while it trains: phase timings, the step log line with progress and ETA, TensorBoard, W&B.

One `StepLog` per stage process (rank 0 / the RL driver). Every step's record goes to TensorBoard and W&B when
enabled; every `--logging_steps`-th step (and the last) also prints one line to the job log:

    [rl] step 5/25 (20%, elapsed 0:00:12, ETA 0:00:48) reward=0.4100 kl=0.0123 ...

The orchestration parses that line for its progress artifact, so its prefix is part of the stage contract.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

TIME_PREFIX = "time/"


class PhaseTimer:
    """Wall time spent in named phases of one step: `with timer.phase("generation"): ...`.

    Phases may repeat within a step (their times add up); `take()` returns {"time/<phase>": seconds} and starts
    the next step from zero.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def take(self) -> dict[str, float]:
        taken = {f"{TIME_PREFIX}{name}": round(seconds, 4) for name, seconds in self._seconds.items()}
        self._seconds = {}
        return taken


# Third-party log lines that repeat (every step, or in every process) and say nothing about this run, by logger.
REPEATED_NOISE = {
    # A weight update reloads every layer; rotary embeddings hold no weights and warn each time.
    "vllm.model_executor.model_loader.reload.layerwise": "RotaryEmbedding: Failed to load weights",
    # Something in the engine asks for its thread count again; vLLM's CPU worker refuses it each time.
    "vllm.v1.worker.cpu_worker": "doesn't allow to use `torch.set_num_threads`",
    # On CPU chunked prefill is off on purpose (stages.rl.rollout.whole_prompt_prefill); vLLM warns that it is.
    "vllm.engine.arg_utils": "does not officially support disabling chunked prefill",
    # --load_in_4bit on CPU: bitsandbytes looks for an optional package of faster kernels in every process and
    # runs its own without it.
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}
# Third-party Python warnings of the same kind, by message: DeepSpeed's ZeRO gathers with a collective that torch
# 2.13 deprecates, and each rank of every stage printed it.
REPEATED_WARNINGS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",)


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def silence_known_noise() -> None:
    """Keep job logs readable: vLLM at WARNING (its INFO lines repeat with every weight update), no loading
    progress bars, and the known per-step warnings above dropped where they are emitted."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # huggingface_hub reads this when it is imported, and transformers asks it when transformers is imported; a
    # module imported already is told directly (a rank actor has imported huggingface_hub by now; importing
    # transformers here would cost every stage process a second before it needs it).
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    for name, text in REPEATED_NOISE.items():
        logging.getLogger(name).addFilter(_DropMessage(text))
    for message in REPEATED_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


@contextmanager
def quiet_model_files() -> Iterator[None]:
    """Loading or writing a model outside a stage (the tiny assets, in the flow's own process), without the lines
    that would open a run's output there: DeepSpeed's note that it picked the CPU (transformers imports DeepSpeed
    whenever it is installed) and transformers' progress bar. Leaves the environment alone: the Ray head that
    process starts, and every stage under it, inherit it."""
    accelerator_note = _DropMessage("Setting accelerator to CPU")
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addFilter(accelerator_note)
    from transformers.utils import logging as transformers_logging

    bars = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        deepspeed_logger.removeFilter(accelerator_note)
        if bars:
            transformers_logging.enable_progress_bar()


def phase_seconds(records: list[dict[str, Any]]) -> dict[str, float]:
    """Total seconds per phase over step records, as stage metrics: {"seconds/<phase>": total}."""
    totals: dict[str, float] = {}
    for record in records:
        for key, value in record.items():
            if key.startswith(TIME_PREFIX):
                name = f"seconds/{key.removeprefix(TIME_PREFIX)}"
                totals[name] = totals.get(name, 0.0) + value
    return {key: round(value, 2) for key, value in totals.items()}


def format_duration(seconds: float) -> str:
    return str(timedelta(seconds=round(max(seconds, 0.0))))


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) >= 1e-3 or value == 0 else f"{value:.3e}"
    return str(value)


class StepLog:
    """Step records of one stage run: printed with progress, sent to TensorBoard and W&B (rank 0 only)."""

    def __init__(self, stage: str, cfg, total_steps: int, start_step: int = 0):
        self.stage = stage
        self.total_steps = total_steps
        self.start_step = start_step
        self.logging_steps = max(getattr(cfg, "logging_steps", 1), 1)
        self.started = time.monotonic()
        self._tensorboard = None
        self._wandb = None
        if cfg.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed attempt wrote past the checkpoint it is resuming from.
            self._tensorboard = SummaryWriter(str(Path(cfg.use_tensorboard) / stage), purge_step=start_step + 1)
        if cfg.use_wandb:
            self._wandb = _start_wandb(stage, cfg)

    def line(self, step: int, record: dict[str, Any]) -> str:
        """The job-log line of a step: progress, elapsed time, ETA, then the record's values."""
        elapsed = time.monotonic() - self.started
        done_here = step - self.start_step
        eta = elapsed / done_here * (self.total_steps - step) if done_here > 0 else math.nan
        percent = 100 * step // max(self.total_steps, 1)
        values = " ".join(f"{key}={value:.3f}" if key.startswith(TIME_PREFIX) else f"{key}={format_value(value)}"
                          for key, value in record.items() if key != "step")
        eta_text = format_duration(eta) if math.isfinite(eta) else "?"
        return (f"[{self.stage}] step {step}/{self.total_steps} ({percent}%, elapsed {format_duration(elapsed)}, "
                f"ETA {eta_text}) {values}")

    def log(self, step: int, record: dict[str, Any]) -> None:
        scalars = {key: float(value) for key, value in record.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(f"{self.stage}/{key}", value, step)
        if self._wandb is not None:
            self._wandb.log({f"{self.stage}/{key}": value for key, value in scalars.items()}, step=step)
        if step % self.logging_steps == 0 or step == self.total_steps:
            print(self.line(step, record), flush=True)

    def summary(self, metrics: dict[str, Any]) -> None:
        """Final metrics of the stage (also for stages without steps, such as evaluation)."""
        scalars = {key: float(value) for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(f"{self.stage}/final/{key}", value, self.total_steps)
        if self._wandb is not None:
            self._wandb.summary.update({f"{self.stage}/{key}": value for key, value in scalars.items()})

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def wandb_dir(cfg) -> Path:
    """Where W&B writes its run files: $WANDB_DIR, else beside --save_path (`<save_path>.wandb`), never inside it:
    the output is committed as the artifact, and W&B's console log and config are no part of the model."""
    return Path(os.environ.get("WANDB_DIR") or Path(cfg.save_path).with_name(Path(cfg.save_path).name + ".wandb"))


def _start_wandb(stage: str, cfg):
    """A W&B run: online with WANDB_API_KEY (or a logged-in machine), otherwise offline files to sync later.

    The key never comes from the config, and the config W&B records is redacted (a token inside a URL), so neither
    lands in W&B. The run id is derived from the checkpoint directory, so a resumed stage continues its run
    instead of starting a new one.
    """
    import wandb

    from infra.secrets import Redactor, redact_streams

    online = bool(os.environ.get("WANDB_API_KEY")) and os.environ.get("WANDB_MODE") != "offline"
    directory = wandb_dir(cfg)  # W&B adds its own wandb/ folder
    directory.mkdir(parents=True, exist_ok=True)
    anchor = getattr(cfg, "ckpt_path", None) or cfg.save_path
    run_id = hashlib.sha256(f"{stage}\0{Path(anchor).resolve()}".encode()).hexdigest()[:16]
    if not online:
        print(f"[{stage}] W&B offline (no WANDB_API_KEY): run files in {directory}; upload with `wandb sync`",
              flush=True)
    run = wandb.init(
        project=cfg.wandb_project, name=cfg.wandb_run_name or stage, id=run_id, resume="allow",
        dir=str(directory), mode="online" if online else "offline", settings=wandb.Settings(quiet=True),
        config=Redactor().data(cfg.model_dump(mode="json")),
    )
    redact_streams(outermost=True)  # W&B's console capture records what reaches it: redacted first
    return run
