"""The plan (preflight): what a pipeline run can check before it spends a GPU-hour, in seconds, starting no job.

    python -m flows.run --preset llama3-8b --plan

- the stage graph of the config's shape: which stage's output feeds which field;
- each stage's resolved command line (the flags its job runs with);
- the Ray resources each stage asks for, against what the cluster offers;
- which stages would be reused: a committed artifact with the same stage key (config, inputs, data content, code);
- the schema of every dataset, checked on its first PLAN_ROWS rows;
- every hub dataset and hub model pinned to the revision the hub names now (`org/name#<sha>` in the plan's config,
  which the flow runs: the revision in the stage key is the one the job reads);
- reward sources: no credentials in endpoint URLs (an Authorization header comes from --remote_rm_auth_env), reward
  files only from the project or RLHF_REWARD_DIRS (a reward file is code every node runs).

A problem (a dataset that cannot be read or fails its schema, a stage asking more than the cluster has, an artifact
store that cannot be read) fails the plan with a message naming the stage and field. The flow runs the same checks
as its first task, against the cluster it is about to use. Run by hand without RLHF_RAY_ADDRESS, the plan compares
with this machine, the embedded Ray head's, and only notes what would not fit (a GPU preset planned on a laptop).
A hub dataset or model is checked and pinned when the hub answers (look-ups retried); without hub access the plan by
hand lists it as not checked and gives that stage no key, and the flow's plan fails, to be retried: a revision it
cannot tell never stands in for one. What the plan shows is redacted (infra/secrets.py).
"""

from __future__ import annotations

import json
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from infra.artifacts import ArtifactError, ChecksumError, open_store
from infra.secrets import Redactor, redact_patterns, url_credentials
from infra.settings import PROJECT_ROOT, Settings
from pipeline.config import PipelineConfig, policy_stage, shape_inputs
from pipeline.gate import PRODUCTION_ALIAS, intact_version, production_baseline
from pipeline.identity import StageResult, stage_code_version, stage_identity, stage_inputs
from pipeline.memory import GIB, ModelShape, render, rl_memory
from pipeline.prepare import prepare
from stages.cli import flag_words
from stages.config import StageConfig
from stages.errors import DataValidationError, StageInputError
from stages.evaluate.suite import benchmark_rows
from stages.fields import Dataset, Launcher, ModelPath, Output, RewardSource, fields_with, names_with
from stages.fingerprint import (
    HubUnavailable,
    dataset_fingerprint,
    hub_file,
    hub_outage_remembered,
    mixture_parts,
    pin_hub_model,
    pin_hub_revision,
    split_revision,
    unpinned_hub_dataset,
)
from stages.placement import bundle_resources, group_bundles
from stages.registry import STAGES

PLAN_ROWS = 64  # rows of each dataset whose schema the plan checks
HUB_UNREACHABLE = "the hub cannot be reached from here (the stage's job reads it on the cluster)"
NODE_WAIT_S = 15.0  # a head started a moment ago lists its node within a few seconds


class PreflightError(ValueError):
    """The plan found problems; the message lists them, each naming the stage and field."""


class ClusterResources(BaseModel):
    """What the stages will be placed on."""

    where: str
    cpus: float
    gpus: float
    binding: bool  # whether asking for more than this fails the plan (a real cluster) or is only noted


class DatasetCheck(BaseModel):
    field: str
    source: str
    fingerprint: str
    schema_check: str  # "ok (64 rows)" or "not checked: why"


class StagePlan(BaseModel):
    stage: str
    inputs: dict[str, str]  # config field -> what feeds it ("sft", "production rl v3", ...)
    command: str
    device: str
    bundles: int  # Ray placement bundles the stage asks for
    bundle: dict[str, float]  # one bundle (on CPU the RL and evaluation roles take a share of a core each)
    key: str | None  # None while an earlier stage would run (its output decides this key), or a revision is unknown
    reused_version: int | None
    datasets: list[DatasetCheck]
    unpinned: bool = False  # a hub dataset or model whose revision could not be told: no key
    memory: list[str] = []  # the per-GPU memory table (RL on GPUs)


class Plan(BaseModel):
    config: PipelineConfig  # as the stages will run it (tiny assets filled, local paths absolute)
    cluster: ClusterResources
    stages: list[StagePlan]
    problems: list[str]
    notes: list[str]

    @property
    def reused_everything(self) -> bool:
        return all(stage.reused_version is not None for stage in self.stages)

    def render(self) -> str:
        config = self.config
        lines = [f"pipeline {config.name!r}, shape {config.shape}: " + " -> ".join(config.stages),
                 f"artifacts: {config.artifact_root}/{config.name}",
                 f"cluster: {self.cluster.where}: {self.cluster.cpus:g} CPU, {self.cluster.gpus:g} GPU", ""]
        for plan in self.stages:
            fed = ", ".join(f"{field} <- {source}" for field, source in plan.inputs.items()) or "nothing"
            asks = " + ".join(f"{value:g} {name}" for name, value in plan.bundle.items())
            if plan.reused_version is not None:
                reuse = f"reuse v{plan.reused_version} (stage key {plan.key[:16]})"
            elif plan.key is None and plan.unpinned:
                reuse = "run (no stage key: a hub revision is unknown here)"
            elif plan.key is None:
                reuse = "run (an earlier stage runs: new inputs)"
            else:
                reuse = f"run (no committed artifact with stage key {plan.key[:16]})"
            lines += [f"[{plan.stage}] inputs: {fed}",
                      f"  ray: {plan.bundles} bundle(s) of {asks} on {plan.device}",
                      f"  would {reuse}"]
            lines += [f"  data {check.field}: {check.source} ({_short_fingerprint(check.fingerprint)}): schema "
                      f"{check.schema_check}" for check in plan.datasets]
            lines += plan.memory
            lines += ["  " + line for line in plan.command.splitlines()]
            lines.append("")
        lines += [f"note: {note}" for note in self.notes]
        lines += [f"PROBLEM: {problem}" for problem in self.problems]
        if not self.problems:
            lines.append("every stage would be reused: nothing to run" if self.reused_everything
                         else "plan OK: nothing found that would fail")
        return Redactor().text("\n".join(lines))


def _short_fingerprint(fingerprint: str) -> str:
    kind, _, value = fingerprint.partition(":")
    return f"{kind}:{value[:16]}" if kind in ("sha256", "s3", "dir") else fingerprint


# ---------------------------------------------------------------------------------------------- the cluster

def cluster_resources(ray_address: str | None, settings: Settings, *, local_binding: bool) -> ClusterResources:
    """The cluster at `ray_address` (its alive nodes' totals), or this machine, where an embedded head runs;
    `local_binding`: whether this machine is where the stages are about to run (the flow) or only the machine a
    plan is made on (by hand)."""
    if ray_address:
        from ray.util.state import list_nodes

        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            nodes = [n for n in list_nodes(address=ray_address, detail=True, raise_on_missing_output=False)
                     if n.state == "ALIVE"]
            if nodes or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        return ClusterResources(where=f"Ray cluster at {ray_address} ({len(nodes)} node(s))", binding=True,
                                cpus=sum(n.resources_total.get("CPU", 0) for n in nodes),
                                gpus=sum(n.resources_total.get("GPU", 0) for n in nodes))  # fmt: skip
    import torch

    return ClusterResources(where="this machine (no RLHF_RAY_ADDRESS: the embedded Ray head)", binding=local_binding,
                            cpus=settings.ray_num_cpus or os.cpu_count() or 1, gpus=torch.cuda.device_count())


def ray_request(stage: str, cfg: StageConfig, device: str, cores: float) -> tuple[int, dict[str, float]]:
    """(bundles, one bundle) that `stage` places with `cfg`, as its entrypoint does (stages/placement.py)."""
    bundles = sum(group_bundles(cfg).values())
    return bundles, bundle_resources(cfg, device, bundles, cores)


# ---------------------------------------------------------------------------------------------- commands

def command_line(stage: str, values: dict, settings: Settings, width: int = 110) -> str:
    """`python -m <prefix>.<stage>` with a flag for every value that differs from the stage's default, wrapped."""
    cls = STAGES[stage]
    hidden = names_with(cls, Output, Launcher)  # the task sets outputs itself; a launcher its --local_rank
    units = [f"python -m {settings.stage_module_prefix}.{stage}"]
    for name, value in values.items():
        default = cls.model_fields[name].default
        if name in hidden or value == (list(default) if isinstance(default, tuple) else default):
            continue
        if isinstance(value, list) and value and isinstance(value[0], dict):  # a preset's list (the eval suite)
            units.append(f"--{name} <the {name} listed below>")
            continue
        units.append(shlex.join(flag_words(name, value)))
    units.append("--save_path <workspace>/output" + (" --ckpt_path <workspace>/ckpt" if "ckpt_path" in values else ""))
    lines = [units[0]]
    for unit in units[1:]:
        if len(lines[-1]) + len(unit) + 1 > width:
            lines[-1] += " \\"
            lines.append("    " + unit)
        else:
            lines[-1] += " " + unit
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- data

def _first_rows(source: str, split: str, fingerprint: str, subset: str | None = None):
    """The first PLAN_ROWS rows of `source` (a hub dataset streamed at its pinned revision)."""
    from stages import data
    from stages.fingerprint import split_revision

    if fingerprint.startswith("hub:"):
        import datasets

        path, split = data.split_source(source, split)
        name, revision = split_revision(path)
        streamed = datasets.load_dataset(name, subset, split=split, revision=revision, streaming=True).take(PLAN_ROWS)
        return datasets.Dataset.from_list(list(streamed))
    return data.load_rows(source, split=split, max_samples=PLAN_ROWS, subset=subset)


def check_datasets(stage: str, cfg: StageConfig, problems: list[str]) -> list[DatasetCheck]:
    """Fingerprint and schema-check every dataset the stage reads; failures go to `problems`."""
    checks = []
    values = cfg.model_dump()
    datasets = sorted(fields_with(type(cfg), Dataset).items(), key=lambda item: item[1].held_out)  # training first
    parts = [(field, role, source) for field, role in datasets if values[field]
             for source in mixture_parts(values[field])]  # a mixture: each of its datasets
    checks_of = [(field, source, lambda rows, source: cfg.validate_rows(rows, source), values[role.split], None)
                 for field, role, source in parts]
    for benchmark in getattr(cfg, "eval_suite", None) or []:  # the evaluation's benchmarks, in their formats
        if benchmark.dataset:
            checks_of.append((f"eval_suite/{benchmark.name}", benchmark.dataset,
                              lambda rows, _, benchmark=benchmark: benchmark_rows(benchmark, rows, cfg),
                              benchmark.split, benchmark.subset))
    for field, source, validate, split, subset in checks_of:
        if unpinned_hub_dataset(source):  # pin_hub_sources could not tell its revision and said so
            checks.append(DatasetCheck(field=field, source=source, fingerprint=f"hub:{source}@unknown",
                                       schema_check=f"not checked: {HUB_UNREACHABLE}"))
            continue
        fingerprint = dataset_fingerprint(source)
        if fingerprint == "missing":
            problems.append(f"{stage}.{field}: {source} does not exist")
            checks.append(DatasetCheck(field=field, source=source, fingerprint=fingerprint, schema_check="missing"))
            continue
        try:
            rows = _first_rows(source, split, fingerprint, subset)
            validate(rows, source)  # what the stage itself checks
            result = f"ok ({len(rows)} rows)"
        except DataValidationError as error:
            problems.append(f"{stage}.{field}: {error}")
            result = "FAILED"
        checks.append(DatasetCheck(field=field, source=source, fingerprint=fingerprint, schema_check=result))
    return checks


# ---------------------------------------------------------------------------------------------- the plan

@hub_outage_remembered()
def build_plan(config: PipelineConfig, settings: Settings, ray_address: str | None, *, artifact_root: str,
               local_binding: bool = False, log: Callable[[str], None] = print) -> Plan:  # fmt: skip
    """The plan of `config` (prepared first: tiny assets built and filled in) against the cluster at
    `ray_address` (None: this machine; see cluster_resources). Reads data and the artifact store; starts nothing."""
    config = prepare(config, log)
    cluster = cluster_resources(ray_address, settings, local_binding=local_binding)
    problems: list[str] = []
    notes: list[str] = []
    config, unpinned = pin_hub_sources(config, problems, notes, must_pin=cluster.binding)
    check_reward_sources(config, settings, problems, artifact_root)
    check_gate_sample(config, notes, problems)
    wiring = shape_inputs(config.shape)
    unused = [s for s in STAGES if s not in config.stages]
    if unused:
        notes.append(f"sections not in shape {config.shape}: {', '.join(unused)} (not run)")
    for stage, fed in wiring.items():
        overridden = [f"{stage}.{field} ({config.section(stage).model_dump()[field]})" for field in fed
                      if config.section(stage).model_dump()[field] is not None]  # fmt: skip
        if overridden:
            notes.append(f"{', '.join(overridden)}: set in the preset but fed by an earlier stage in this shape")

    try:
        store = open_store(artifact_root, config.name, log=log)
        store.versions(config.stages[0])
    except (ArtifactError, OSError) as error:
        problems.append(f"artifact_root: cannot read the artifact store {artifact_root}: {error}")
        store = None
    results: dict[str, StageResult | None] = {}
    plans = []
    for stage in config.stages:
        section = config.section(stage)
        inputs = {field: f"{producer} output" for field, producer in wiring[stage].items()}
        production = _production(store, config, results) if stage == "evaluate" and store is not None else None
        if production is not None:
            inputs["production_pretrain"] = f"production {production.stage} v{production.version}"
        elif stage == "evaluate" and store is not None:
            _note_damaged_production(store, policy_stage(config.shape), notes)
        upstream = stage_inputs(config, stage, results, production)
        shown = section.model_dump(mode="json") | {field: f"<{source}>" for field, source in inputs.items()}
        device = section.device if section.device != "auto" else ("cuda" if cluster.gpus > 0 else "cpu")
        bundles, bundle = ray_request(stage, type(section).model_validate(shown), device, cluster.cpus)
        _check_fit(stage, device, bundles, bundle, cluster, problems, notes)
        datasets = check_datasets(stage, section, problems)
        memory = memory_plan(config, stage, wiring, settings, problems, notes) if device == "cuda" else []
        key = reused = None
        if store is not None and stage not in unpinned and all(result is not None for result in upstream.values()):
            key = stage_identity(config.name, stage, section, upstream, stage_code_version(settings, stage)).key
            existing = store.find_by_stage_key(stage, key)
            if existing is not None:
                try:
                    store.verify_for_reuse(existing)
                except ChecksumError as damage:  # the stage's task quarantines it and builds it again
                    notes.append(f"{stage}: committed v{existing.version} is damaged ({damage}): it will be "
                                 "quarantined and built again")
                    existing = None
            if existing is not None:
                reused = existing.version
                results[stage] = StageResult.from_manifest(existing, reused=True)
        results.setdefault(stage, None)
        plans.append(StagePlan(stage=stage, inputs=inputs, command=command_line(stage, shown, settings), device=device,
                               bundles=bundles, bundle=bundle, key=key, reused_version=reused, datasets=datasets,
                               unpinned=stage in unpinned, memory=memory))
    return Plan(config=config, cluster=cluster, stages=plans, problems=problems, notes=notes)


def check_gate_sample(config: PipelineConfig, notes: list[str], problems: list[str]) -> None:
    """Say how many prompts the gate judges on, and refuse an evaluation too small for the gate to decide on."""
    if "evaluate" not in config.stages:
        return
    most, least = config.evaluate.max_samples, config.gate.min_prompts
    how = "each rule on its 95% interval" if config.gate.decide_on_intervals else "each rule on the difference"
    notes.append(f"gate: judges the candidate on at most evaluate.max_samples={most} held-out prompts ({how}), and "
                 f"on fewer than gate.min_prompts={least} keeps production")
    if most < least:
        problems.append(f"evaluate.max_samples={most} is below gate.min_prompts={least}: no candidate could ever "
                        "be promoted")
    suite = {benchmark.name: benchmark for benchmark in config.evaluate.eval_suite or []}
    for benchmark in suite.values():
        rules = [rule.metric for rule in config.gate.rules if rule.benchmark == benchmark.name]
        seen = _benchmark_prompts(benchmark, config.evaluate)
        notes.append(f"eval suite: {benchmark.name} ({benchmark.format}, {benchmark.dataset}@{benchmark.split}, "
                     f"{seen}, {benchmark.n_samples} samples per prompt)"
                     + (f"; gate rules on its {', '.join(rules)}" if rules else "; no gate rule"))
        if rules and benchmark.max_samples < least:
            problems.append(f"evaluate.eval_suite {benchmark.name}: max_samples={benchmark.max_samples} is below "
                            f"gate.min_prompts={least}: its gate rules could never pass")


def _benchmark_prompts(benchmark, cfg: StageConfig) -> str:
    """How many prompts a benchmark's models answer (up to max_samples), where the plan can read its data here."""
    from stages import data

    if benchmark.dataset is None or unpinned_hub_dataset(benchmark.dataset) or dataset_fingerprint(
            benchmark.dataset).startswith(("hub:", "missing")):
        return f"at most {benchmark.max_samples} prompts"
    try:
        rows = data.load_rows(benchmark.dataset, split=benchmark.split, max_samples=benchmark.max_samples,
                              subset=benchmark.subset)
        prompts, _ = benchmark_rows(benchmark, rows, cfg)
    except DataValidationError:  # check_datasets reports it
        return f"at most {benchmark.max_samples} prompts"
    return f"{len(prompts)} prompts"


def pin_hub_sources(config: PipelineConfig, problems: list[str], notes: list[str], *, must_pin: bool,
                    ) -> tuple[PipelineConfig, set[str]]:  # fmt: skip
    """`config` with every hub dataset and hub model of its stages pinned to its current revision (a model field
    that an earlier stage's output fills is left alone), and the stages left with one it could not pin: a problem
    where the run is about to start (`must_pin`), a note for a plan made by hand."""
    unpinned: set[str] = set()
    sections = {}
    wiring = shape_inputs(config.shape)
    for stage in config.stages:
        section = config.section(stage)
        pins = {field: pin_hub_revision for field in fields_with(type(section), Dataset)}
        pins |= {field: pin_hub_model for field in fields_with(type(section), ModelPath) if field not in wiring[stage]}

        def pinned(where: str, source: str, pin: Callable[[str], str]) -> str:
            try:
                return pin(source)
            except HubUnavailable as error:
                unpinned.add(stage)
                (problems if must_pin else notes).append(
                    f"{where}: {error}" + ("; retry when the hub answers" if must_pin else
                                           "; not pinned here, the flow's plan pins it"))
            except StageInputError as error:
                problems.append(f"{where}: {error}")
            return source

        values = {field: pinned(f"{stage}.{field}", getattr(section, field), pin) for field, pin in pins.items()
                  if getattr(section, field)}
        if getattr(section, "eval_suite", None):  # the evaluation's benchmarks: hub datasets too
            values["eval_suite"] = [benchmark.model_copy(update={"dataset": pinned(
                f"{stage}.eval_suite {benchmark.name}", benchmark.dataset, pin_hub_revision)})
                if benchmark.dataset else benchmark for benchmark in section.eval_suite]
        sections[stage] = section.model_copy(update=values)
    return config.model_copy(update=sections), unpinned


def check_reward_sources(config: PipelineConfig, settings: Settings, problems: list[str],
                         artifact_root: str | None = None) -> None:
    """Endpoints without credentials in their URLs; reward files from the project's configs/ and stages/ or
    RLHF_REWARD_DIRS only, never from where jobs write."""
    for stage in config.stages:
        section = config.section(stage)
        for field in fields_with(type(section), RewardSource):
            spec = getattr(section, field)
            if not spec:
                continue
            urls = [part.strip() for part in spec.split(",") if part.strip().startswith(("http://", "https://"))]
            for url in urls:
                if found := url_credentials(url):
                    problems.append(f"{stage}.{field}: {redact_patterns(url)}: credentials in the URL are refused "
                                    f"({', '.join(found)}); name a variable holding the Authorization header with "
                                    f"{stage}.remote_rm_auth_env")
            path = Path(spec) if Path(spec).exists() else PROJECT_ROOT / spec  # as the stage resolves it
            if not urls and (spec.endswith(".py") or path.is_dir()) and not settings.reward_file_allowed(
                    path, artifact_root):
                problems.append(f"{stage}.{field}: {spec} is outside the project's configs/ and stages/ and "
                                "RLHF_REWARD_DIRS, or in a folder jobs write (the workspace, the artifact root): a "
                                "reward file is code that every node runs; put it in a folder of RLHF_REWARD_DIRS")


def _note_damaged_production(store, stage: str, notes: list[str]) -> None:
    record = store.alias_record(stage, PRODUCTION_ALIAS)
    why = store.quarantined(stage).get(record["version"]) if record else None
    if why is not None:
        notes.append(f"production: {stage} v{record['version']} is quarantined ({why}): the evaluation scores no "
                     "production policy, the gate judges the candidate on its reference alone, and a candidate that "
                     "passes replaces it")


def _production(store, config: PipelineConfig, results: dict) -> StageResult | None:
    """The production policy the evaluation will score beside the candidate: the flow's production_policy of a
    reused candidate, or (the candidate will be trained anew) what the alias points at now."""
    candidate = results.get(policy_stage(config.shape))
    if candidate is not None:
        return production_baseline(store, candidate)
    record = store.alias_record(policy_stage(config.shape), PRODUCTION_ALIAS)
    return intact_version(store, policy_stage(config.shape), record["version"]) if record else None


def base_model(config: PipelineConfig, stage: str, field: str, wiring: dict[str, dict[str, str]]) -> str | None:
    """The model a field of `stage` starts from: the field's value, or for a field an earlier stage feeds, what that
    stage trained from (its architecture, and so its memory, is the same)."""
    producer = wiring[stage].get(field)
    if producer is not None:
        return base_model(config, producer, "pretrain", wiring)
    return getattr(config.section(stage), field)


def model_shape(source: str) -> ModelShape:
    """The shape of the model at `source` from its config.json: a local folder, an fsspec URI or a hub name (the
    hub's file, or the local hub cache offline)."""
    if Path(source).expanduser().is_dir():
        text = (Path(source).expanduser() / "config.json").read_text()
    elif "://" in source:
        import fsspec

        with fsspec.open(f"{source.rstrip('/')}/config.json", "r") as handle:
            text = handle.read()
    else:
        name, revision = split_revision(source)
        text = hub_file(name, "config.json", revision).read_text()
    return ModelShape.from_config(json.loads(text))


def memory_plan(config: PipelineConfig, stage: str, wiring: dict[str, dict[str, str]], settings: Settings,
                problems: list[str], notes: list[str]) -> list[str]:
    """The per-GPU memory table of an RL stage on GPUs; a problem when a GPU group would not fit."""
    if stage != "rl":
        return []
    cfg = config.section(stage)
    actor = base_model(config, stage, "pretrain", wiring)
    sources = {"actor": actor, "ref": cfg.ref_pretrain or actor,
               "critic": base_model(config, stage, "critic_pretrain", wiring) or (
                   base_model(config, stage, "reward_pretrain", wiring) or actor),
               "reward": base_model(config, stage, "reward_pretrain", wiring)}
    shapes = {}
    for role, source in sources.items():
        if role in cfg.role_ranks() and source:
            try:
                shapes[role] = model_shape(str(source))
            except Exception as error:  # noqa: BLE001 - any failure to read a config only leaves the table out
                notes.append(f"{stage}: no memory estimate for {role} ({source}): cannot read its config.json "
                             f"({type(error).__name__})")
    gpu_bytes = settings.gpu_memory_gib * GIB
    groups = rl_memory(cfg, shapes, gpu_bytes)
    unknown = [role for role in cfg.role_ranks() if role not in shapes]
    if unknown and cfg.colocate_all_models:  # a shared peak without some of the models would understate it
        return render(groups, gpu_bytes)[:-1] + [f"    peak not estimated: no shape for {', '.join(unknown)}"]
    for group in groups:
        too_big = {phase: total for phase, total in group.phases.items() if total > gpu_bytes}
        if too_big:
            also = {phase: total for phase, total in too_big.items() if phase != group.peak_phase}
            problems.append(
                f"{stage}: the GPUs {group.where} need about {group.peak / GIB:.1f} GiB each in the "
                f"{group.peak_phase} phase"
                + (f" (also over {settings.gpu_memory_gib:g} GiB: "
                   f"{', '.join(f'{phase} {total / GIB:.1f}' for phase, total in also.items())})" if also else "")
                + f", more than the {settings.gpu_memory_gib:g} GiB of a GPU (RLHF_GPU_MEMORY_GIB): raise "
                "--zero_stage, set --adam_offload, --gradient_checkpointing or the sleep flags, lower the micro-batch "
                "sizes")
    return render(groups, gpu_bytes)


def _check_fit(stage: str, device: str, bundles: int, bundle: dict[str, float], cluster: ClusterResources,
               problems: list[str], notes: list[str]) -> None:  # fmt: skip
    needs = {name: bundles * amount for name, amount in bundle.items()}
    has = {"GPU": cluster.gpus, "CPU": cluster.cpus}
    short = [f"{needs[name]:g} {name} (has {has[name]:g})" for name in needs if needs[name] > has[name] + 1e-9]
    if not short:
        return
    if device == "cuda" and not cluster.gpus:
        fields = f"{stage}.device cuda"
    else:
        fields = f"{stage}.{STAGES[stage].rank_flags}"
    message = f"{fields}: {stage} asks {bundles} bundle(s), {', '.join(short)}, of {cluster.where}"
    (problems if cluster.binding else notes).append(
        message if cluster.binding else message + "; set RLHF_RAY_ADDRESS to plan against the cluster it runs on"
    )


def raise_for_problems(plan: Plan) -> None:
    if plan.problems:
        raise PreflightError(f"preflight of pipeline {plan.config.name!r} found {len(plan.problems)} problem(s):\n"
                             + "\n".join(f"- {problem}" for problem in plan.problems))
