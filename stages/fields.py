"""What a config field is, declared once where the field is defined (`Annotated[type, role]`).

Everything that treats fields by what they are derives its list from these declarations: the stage key (datasets
and reward files are fingerprinted, outputs left out), checkpoint ownership (fields that do not change training
left out), the plan (schemas of datasets, placeholders for outputs), path resolution (local paths made absolute),
the rehearsal (model stand-ins by kind, dataset fixtures, CPU values) and the once-per-run notes about flags that
cannot act on CPU, the fields a deployment run may set otherwise than its deployment (`RunOverride`), and those whose
string names a file that only a person's own config may have read (`FileValued`). A new
dataset field needs nothing but its `Dataset(...)` role to enter all of them.

    dataset: Annotated[str | None, Dataset(split="dataset_split")] = Field(None, description="...")
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationInfo


@dataclass(frozen=True)
class Dataset:
    """Data the stage reads: hub name, local file or folder, or s3:// URI. Its content is part of the stage key,
    the plan checks its schema, the rehearsal replaces it by a fixture in the same format."""

    split: str  # the field that names the split to read
    held_out: bool = False  # rows to evaluate on, never trained on


@dataclass(frozen=True)
class ModelPath:
    """A model the stage loads (HF dir, hub name or s3:// URI). `kind` is what the rehearsal puts in its place:
    a model to fine-tune ("base"), a fine-tuned policy ("policy") or a value-head model ("scorer")."""

    kind: Literal["base", "policy", "scorer"]


@dataclass(frozen=True)
class RewardSource:
    """Code the stage runs, named by a flag: a reward function (a Python file, or endpoints) or a folder of code
    (lm-eval task files). Read like data (its content is part of the stage key); the plan takes local ones only from the
    project's own folders and RLHF_REWARD_DIRS."""


@dataclass(frozen=True)
class Output:
    """Where the stage writes. The orchestration sets it per workspace; it is part of no identity."""


@dataclass(frozen=True)
class Launcher:
    """Set by a launcher for its process (`--local_rank`): part of no identity, never on a command line."""


@dataclass(frozen=True)
class NotTraining:
    """Changes what is logged, evaluated or kept, not what is trained: checkpoints written with another value
    may be resumed from."""


@dataclass(frozen=True)
class RunOverride:
    """A deployment run may give it another value than the deployment's own parameters: how much to train and how
    often to checkpoint or log. Everything else (models, data, reward sources, the gate and what it judges on,
    where artifacts go) only the deployment sets. With `at_least`, a run's value may not go below it; with
    `at_most_deployed`, not above the deployment's own when that is at least `at_least` (a run cannot turn
    checkpoints off, nor make them rarer than the deployment's)."""

    at_least: int | None = None
    at_most_deployed: bool = False


@dataclass(frozen=True)
class GpuOnly:
    """Acts on GPUs only; on CPU it amounts to `cpu_value`, and a run set otherwise says `why` once."""

    cpu_value: Any
    why: str


@dataclass(frozen=True)
class FileValued:
    """A string here names a file whose content is the value (a YAML suite, a preset to extend). Files are read only
    where a person's own files are loaded (a preset, a --config file, a command line: validation with
    `FILES_MAY_BE_READ` as its context); anywhere else (a deployment run's parameters, a job's config) the string is
    refused before anything opens it. `installed`: names of things the install ships (presets), accepted anywhere."""

    installed: Callable[[], list[str]] = list


# Validation context under which FileValued fields may read the file a string names.
FILES_MAY_BE_READ = {"files_may_be_read": True}


def files_may_be_read(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("files_may_be_read"))


REWARD_SOURCE, OUTPUT, LAUNCHER, NOT_TRAINING = RewardSource(), Output(), Launcher(), NotTraining()
RUN_OVERRIDE = RunOverride()
RUN_OVERRIDE_KEEPING_CHECKPOINTS = RunOverride(at_least=1, at_most_deployed=True)
Role = TypeVar("Role")


def fields_with(config_cls: type[BaseModel], role: type[Role]) -> dict[str, Role]:
    """{field name: its role declaration} of the fields of `config_cls` declared with a role of type `role`."""
    found = {}
    for name, field in config_cls.model_fields.items():
        for item in field.metadata:
            if isinstance(item, role):
                found[name] = item
    return found


def names_with(config_cls: type[BaseModel], *roles: type) -> frozenset[str]:
    """Names of the fields of `config_cls` declared with any of `roles`."""
    return frozenset(name for role in roles for name in fields_with(config_cls, role))


def path_fields(config_cls: type[BaseModel]) -> frozenset[str]:
    """Fields that may name a local path: models, datasets, reward files."""
    return names_with(config_cls, ModelPath, Dataset, RewardSource)


def cpu_notes(cfg: BaseModel) -> list[str]:
    """One line per GPU-only field of `cfg` set to what it cannot do on CPU, naming its flag as given."""
    notes = []
    for name, role in fields_with(type(cfg), GpuOnly).items():
        value = getattr(cfg, name)
        if value != role.cpu_value:
            flag = (f"--{name}" if value else f"--no_{name}") if isinstance(value, bool) else f"--{name} {value}"
            notes.append(f"{flag} has no effect on CPU: {role.why}")
    return notes
