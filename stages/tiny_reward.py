"""The tiny task's rule reward as a file usable by path (like ``--remote_rm_url stages/tiny_reward.py``)."""

import sys
from pathlib import Path

# Loaded by path, this file may run where the repository is not on sys.path.
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.append(_REPO_ROOT)

from stages.tiny import reward_func  # noqa: E402

__all__ = ["reward_func"]
