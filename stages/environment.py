"""What a stage process reads from its environment (`RLHF_*` variables), checked in one place: a bad value stops the
stage with an error that names the variable (exit 2), instead of a bare ValueError deep in a rank."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from stages.errors import StageInputError


class StageEnvironment(BaseSettings):
    """The stage processes' own settings; the orchestration's are infra/settings.py's."""

    model_config = SettingsConfigDict(env_prefix="RLHF_", extra="ignore", env_ignore_empty=True)

    cpu_cores: int | None = Field(
        None, ge=1,
        description="Caps the cores a stage process counts on its node (compute threads, encoding processes), for "
        "a machine that also runs other work; unset = the node's cores (RLHF_CPU_CORES).",
    )
    example_cache_days: float = Field(
        7.0, ge=0,
        description="Prepared examples no stage used for this many days are removed when a stage prepares its "
        "own (RLHF_EXAMPLE_CACHE_DAYS).",
    )
    cache_dir: Path = Field(
        default_factory=lambda: Path.home() / ".cache" / "rlhf-models",
        description="Where s3:// models are downloaded; unset = ~/.cache/rlhf-models of the user the stage runs as "
        "(RLHF_CACHE_DIR).",
    )


def stage_environment() -> StageEnvironment:
    """The settings from the environment as it is now."""
    try:
        return StageEnvironment()
    except ValidationError as error:
        problems = "; ".join(f"RLHF_{str(e['loc'][0]).upper()}={e['input']!r}: {e['msg']}" for e in error.errors())
        raise StageInputError(f"environment: {problems}") from None
