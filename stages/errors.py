"""How a stage fails, and the exit codes that tell the orchestration whether a retry can help.

Exit codes are part of the stage contract: 0 success, 2 config or data error (a retry cannot fix it), 4 another
process is writing the same checkpoint/output directory, anything else a failure that a retry may fix.
"""

from __future__ import annotations

EXIT_CONFIG_ERROR = 2
EXIT_WORKSPACE_BUSY = 4


class StageInputError(ValueError):
    """A problem with the stage's configuration or data (or a run that diverges on them): a retry cannot fix it."""


class DataValidationError(StageInputError):
    """Bad or unreadable data; the message names the file, every failed check and the row numbers."""


class WorkspaceBusy(RuntimeError):
    """Another live process holds the writer lock of this stage's checkpoint/output directory."""
