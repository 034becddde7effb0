"""How a stage fails, and the exit codes that tell the orchestration whether a retry can help.

Exit codes are part of the stage contract: 0 success, 2 config or data error (a retry cannot fix it), 4 another
process is writing the same checkpoint/output directory, anything else a failure that a retry may fix (1: an
outage of the hub, S3 or a reward endpoint that outlasted the stage's own retries, a crash).
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_CONFIG_ERROR = 2
EXIT_WORKSPACE_BUSY = 4


class StageInputError(ValueError):
    """A problem with the stage's configuration or data (or a run that diverges on them): a retry cannot fix it."""


class DataValidationError(StageInputError):
    """Bad or unreadable data; the message names the file, every failed check and the row numbers."""


class SourceUnavailable(RuntimeError):
    """Data, a model or a reward endpoint could not be reached for longer than the stage retries: the next attempt
    may find it back (exit 1)."""


class WorkspaceBusy(RuntimeError):
    """Another live process holds the writer lock of this stage's checkpoint/output directory."""


def exit_code(error: BaseException) -> int:
    """The exit code a stage ends with after `error` (a rank's error arrives wrapped by Ray, an instance of it)."""
    if isinstance(error, WorkspaceBusy):
        return EXIT_WORKSPACE_BUSY
    if isinstance(error, StageInputError):
        return EXIT_CONFIG_ERROR
    return EXIT_FAILURE
