"""transformers imported without two optional packages that no stage uses, in the processes that load models.

transformers imports scikit-learn whenever it is installed (assisted generation's confidence threshold,
`transformers/generation/candidate_generator.py`, reached from every `AutoModelFor...` and from vLLM's `LLM`), and
peft with bitsandbytes (which imports torch's inductor) whenever peft is installed (the Trainer's helpers,
`transformers/trainer_utils.py`, reached from `get_scheduler`). lm-eval installs scikit-learn; LoRA needs peft.
Measured on 2 cores (transformers 5.19): a training rank's `import torch; from transformers import
AutoModelForCausalLM, get_scheduler` takes 11.0 to 12.7 CPU-seconds, 6.6 to 7.8 without the two; the test suite
starts about 150 such processes, an 8-GPU job one per GPU and engine. No stage uses assisted generation or the
Trainer; a LoRA run imports peft itself where it needs it (stages/lora.py), and lm-eval imports scikit-learn itself.
"""

from __future__ import annotations

import importlib
import sys

# The module to import lean, and the availability check in transformers.utils it reads once, at its import.
LEAN_MODULES = {
    "transformers.generation.candidate_generator": "is_sklearn_available",
    "transformers.trainer_utils": "is_peft_available",
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
