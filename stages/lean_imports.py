"""transformers imported without three optional packages that no stage uses, in the processes that load models.

Whenever they are installed, transformers imports scikit-learn for assisted generation's confidence threshold
(`generation/candidate_generator.py`, reached from every `AutoModelFor...` and from vLLM's `LLM`), scipy's optimizer
for the object-detection losses (`loss/loss_utils.py`, reached from the same), and peft with bitsandbytes for the
Trainer's helpers (`trainer_utils.py`, reached from `get_scheduler`). lm-eval installs scikit-learn and scipy; LoRA
needs peft. Measured on 2 cores (transformers 5.19, CPU-seconds of the whole process): a rank's imports, model load
and LR schedule 8.7 to 10.4 with them, 5.8 to 7.6 without; an HF rollout engine's start 9.1 with scipy, 5.8 to
6.3 without. The test suite starts about 150 such processes, an 8-GPU job one per GPU and engine. No stage uses
assisted generation, detection losses or the Trainer; a LoRA run imports peft itself where it needs it
(stages/lora.py), and lm-eval imports what its metrics need.
"""

from __future__ import annotations

import importlib
import sys

# The module to import lean, and the availability check in transformers.utils it reads once, at its import.
LEAN_MODULES = {
    "transformers.generation.candidate_generator": "is_sklearn_available",
    "transformers.trainer_utils": "is_peft_available",
    "transformers.loss.loss_utils": "is_scipy_available",
}


def lean_transformers() -> None:
    """Import LEAN_MODULES with their optional package reported absent while they import; transformers.utils' checks
    answer truly again afterwards. Call before the first `from transformers import AutoModelFor...`,
    `get_scheduler` or `from vllm import LLM` of a process; once they are imported it does nothing."""
    missing = [name for name in LEAN_MODULES if name not in sys.modules]
    if not missing:
        return
    import transformers.utils as transformers_utils

    checks = {name: getattr(transformers_utils, name) for name in set(LEAN_MODULES.values())}
    try:
        for name in checks:
            setattr(transformers_utils, name, lambda: False)
        for module in missing:
            importlib.import_module(module)
    finally:
        for name, check in checks.items():
            setattr(transformers_utils, name, check)
