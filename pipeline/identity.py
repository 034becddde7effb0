"""A stage's identity: what it is given (resolved config, input artifacts, data content, code), hashed into its key.

The stage key covers the stage config, the digests of its input artifacts, a fingerprint of the content of every
dataset and local reward function it reads (stages/fingerprint.py) and the code its job runs (pipeline/code.py):
new data at the same path retrains the stage, and with it every stage after it; nothing changed, nothing runs.
Which fields are data, and which are outputs left out of the key, the fields themselves declare (stages/fields.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from infra.artifacts import DatasetRef, Manifest
from infra.settings import Settings
from pipeline.code import code_version, imported_code_version
from pipeline.config import PipelineConfig, shape_inputs
from stages.fields import Dataset, Output, RewardSource, fields_with, names_with
from stages.fingerprint import code_folder_fingerprint, dataset_fingerprint
from stages.registry import STAGES


class StageResult(BaseModel):
    """What a stage hands to the next one and to Prefect's result store: a reference, never weights."""

    pipeline: str
    stage: str
    version: int
    uri: str
    digest: str
    stage_key: str
    metrics: dict[str, float | int | str]
    reused: bool = False  # found committed with this stage key: no job ran

    @classmethod
    def from_manifest(cls, manifest: Manifest, reused: bool = False) -> StageResult:
        return cls(
            pipeline=manifest.pipeline,
            stage=manifest.stage,
            version=manifest.version,
            uri=manifest.uri,
            digest=manifest.digest,
            stage_key=manifest.stage_key or "",
            metrics=manifest.metrics,
            reused=reused,
        )


def stage_code_version(settings: Settings, stage: str) -> str:
    """The code a stage job runs: RLHF_CODE_VERSION, else the hash of its entrypoint module's closure."""
    return settings.code_version or code_version(f"{settings.stage_module_prefix}.{stage}")


def config_class(stage: str, config: BaseModel | dict) -> type[BaseModel] | None:
    """The config class whose field roles apply: the model's own, else the stage's (None for an unknown stage)."""
    return type(config) if isinstance(config, BaseModel) else STAGES.get(stage)


def stage_key(pipeline: str, stage: str, config: dict, input_digests: dict[str, str], code: str,
              data: dict[str, str] | None = None) -> str:
    """Identity of a stage's work: same key, same output. `input_digests` maps each config field fed by an input
    artifact to its digest (its URI is left out, the digest counts); `data` maps each data field to its fingerprint.
    Output fields (where the stage writes) are left out."""
    cls = STAGES.get(stage)
    outputs = names_with(cls, Output) if cls is not None else frozenset()
    keyed_config = {k: v for k, v in config.items() if k not in outputs and k not in input_digests}
    payload = json.dumps(
        {"pipeline": pipeline, "stage": stage, "config": keyed_config, "inputs": input_digests, "data": data or {},
         "code": code},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def data_sources(config_cls: type[BaseModel] | None, config: dict) -> dict[str, str]:
    """{field: source} of the data a resolved stage config reads: its datasets and a local reward function file."""
    if config_cls is None:
        return {}
    sources = {field: config[field] for field in fields_with(config_cls, Dataset) if config.get(field)}
    for benchmark in config.get("eval_suite") or []:  # the evaluation's benchmarks: datasets too
        if benchmark.get("dataset"):
            sources[f"eval_suite/{benchmark['name']}"] = benchmark["dataset"]
    for field in fields_with(config_cls, RewardSource):
        reward = config.get(field)
        if isinstance(reward, str) and "://" not in reward and (reward.endswith(".py") or Path(reward).is_dir()):
            sources[field] = reward
    return sources


def source_fingerprint(source: str, code: bool = False) -> str:
    """The fingerprint of data a stage reads; a local reward function's also covers the project code it imports
    (configs/reward_funcs/math_answer.py compares answers with stages/answers.py). `code`: the source is code the
    stage runs (a RewardSource); a folder of it (lm-eval task files, whose `!function` entries are Python) is
    fingerprinted over every file in it, not only its data files."""
    if code and "://" not in source and Path(source).is_dir():
        return code_folder_fingerprint(Path(source))
    fingerprint = dataset_fingerprint(source)
    if source.endswith(".py") and "://" not in source and Path(source).is_file():
        imported = imported_code_version(Path(source))
        if imported is not None:
            fingerprint += f"+code:{imported[:16]}"
    return fingerprint


class StageIdentity(BaseModel):
    """A stage's resolved config, the fingerprints of the data it reads, and the key they make."""

    key: str
    config: dict[str, Any]
    datasets: dict[str, DatasetRef]


def stage_identity(pipeline: str, stage: str, config: BaseModel | dict, inputs: dict[str, StageResult],
                   code: str) -> StageIdentity:  # fmt: skip
    """Resolve `config` with `inputs` (config field -> upstream result) and fingerprint its data: the key."""
    resolved = resolve_config(stage, config, inputs)
    config_cls = config_class(stage, config)
    code_fields = fields_with(config_cls, RewardSource) if config_cls is not None else {}
    datasets = {field: DatasetRef(source=source, fingerprint=source_fingerprint(source, code=field in code_fields))
                for field, source in data_sources(config_cls, resolved).items()}
    key = stage_key(pipeline, stage, resolved, {field: r.digest for field, r in inputs.items()}, code,
                    {field: ref.fingerprint for field, ref in datasets.items()})
    return StageIdentity(key=key, config=resolved, datasets=datasets)


def resolve_config(stage: str, config: BaseModel | dict, inputs: dict[str, StageResult]) -> dict[str, Any]:
    """The stage config as plain data, with each input artifact's URI in the field it feeds."""
    resolved = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
    known = type(config).model_fields if isinstance(config, BaseModel) else resolved
    for field, result in inputs.items():
        if field not in known:
            raise ValueError(f"stage {stage!r}: input for unknown config field {field!r}")
        resolved[field] = result.uri
    return resolved


def stage_inputs(config: PipelineConfig, stage: str, results: dict[str, StageResult | None],
                 production: StageResult | None = None) -> dict[str, StageResult | None]:
    """{config field: the result that feeds it} of `stage`: the outputs of earlier stages of the shape, and for the
    evaluation the production policy it scores beside the candidate (when there is one)."""
    inputs = {field: results.get(producer) for field, producer in shape_inputs(config.shape)[stage].items()}
    if stage == "evaluate" and production is not None:
        inputs["production_pretrain"] = production
    return inputs

