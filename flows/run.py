"""The embedded default: run the full-rlhf flow in this process on one machine, plan it, or rehearse it.

    python -m flows.run --preset tiny [--artifact_root DIR]
    python -m flows.run --preset llama3-8b --plan         # the preflight alone: seconds, no job
    python -m flows.run --preset llama3-8b --rehearse     # the preset on CPU with tiny stand-ins (pipeline/rehearsal.py)

Without PREFECT_API_URL, Prefect starts a temporary local server for the run (its database stays in
PREFECT_HOME, so `prefect server start` shows the run afterwards). Without RLHF_RAY_ADDRESS, the flow starts
a local Ray head when a stage has to run and stops it at the end. With `tiny_assets_dir` in the preset (tiny
does), the tiny model and datasets are built there first. Exits non-zero when the run (or the plan) fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

from flows.results import PipelineResult
from infra.settings import get_settings
from pipeline.config import PipelineConfig, load_pipeline_config
from stages.config import ConfigError, preset_names

DEFAULT_REHEARSAL_ROOT = "./artifacts/rehearsal"


def headline_metrics(metrics: dict) -> dict:
    """The metrics a summary shows: not the grouped ones (`suite/...`, `seconds/...`, `startup/...`) nor the
    confidence bounds (`..._low`, `..._high`); the manifest and the evaluation report hold them all."""
    return {name: value for name, value in sorted(metrics.items())
            if "/" not in name and not name.endswith(("_low", "_high"))}


def metrics_table(result: PipelineResult, width: int = 120) -> str:
    """One row per stage: version, whether it was reused, digest and its headline metrics (wrapped to `width`)."""
    lead = f"{'stage':<13} {'version':<8} {'':<7} {'digest':<13} "
    lines = [lead + "metrics"]
    for stage, artifact in result.stages.items():
        metrics = ", ".join(
            f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in headline_metrics(artifact.metrics).items()
        )
        reused = "reused" if artifact.reused else "trained" if stage != "evaluate" else "ran"
        row = f"{stage:<13} v{artifact.version:<7} {reused:<7} {artifact.digest[:12]:<13} "
        lines += textwrap.wrap(metrics, width, initial_indent=row, subsequent_indent=" " * len(lead),
                               break_on_hyphens=False) or [row]
    return "\n".join(lines)


def plan(config: PipelineConfig) -> int:
    """Print the preflight plan of `config`; 0 when it found no problem."""
    from flows.full_rlhf import artifact_root_for
    from pipeline.plan import build_plan

    settings = get_settings()
    result = build_plan(config, settings, settings.ray_address, artifact_root=artifact_root_for(config, settings),
                        log=lambda message: print(message, file=sys.stderr))
    print(result.render())
    return 1 if result.problems else 0


def rehearsal_config(config: PipelineConfig, root: Path) -> PipelineConfig:
    """The rehearsal of `config` under `root` (stand-ins, fixtures, artifacts), its swap table printed."""
    from pipeline.rehearsal import build_stand_ins, rehearse_pipeline, swap_table

    stand_ins = build_stand_ins(root / "stand-ins")
    rehearsed, swaps = rehearse_pipeline(config, stand_ins, str(root / "artifacts"))
    print(f"rehearsal of {config.name} ({config.shape}) on CPU: the preset's settings, but for these swaps\n")
    print(swap_table(swaps) + "\n")
    # The rehearsal's store beats any RLHF_ARTIFACT_ROOT of this environment (a worker pinned to a bucket).
    os.environ["RLHF_ARTIFACT_ROOT"] = rehearsed.artifact_root
    return rehearsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run, plan or rehearse the full-rlhf flow in-process (local "
                                     "Prefect, local Ray).")  # fmt: skip
    parser.add_argument("--preset", default="tiny", help=f"preset name ({', '.join(preset_names())}) or YAML path")
    parser.add_argument(
        "--artifact_root",
        help="artifact store root (path, file:// or s3://); default: the preset's. A local one also holds the "
        f"tiny assets (<root>/tiny-assets) when the preset builds them. With --rehearse: the rehearsal's folder "
        f"(default {DEFAULT_REHEARSAL_ROOT})",
    )
    parser.add_argument("--plan", action="store_true",
                        help="print the preflight plan (stage graph, commands, Ray resources, reuse, data schemas) "
                        "and exit: non-zero when it finds a problem; starts no job")  # fmt: skip
    parser.add_argument("--rehearse", action="store_true",
                        help="run the preset on this CPU machine with tiny stand-ins: its settings kept but for the "
                        "swaps printed first (with --plan: plan the rehearsal)")  # fmt: skip
    args = parser.parse_args(argv)

    try:
        config = load_pipeline_config(args.preset)
        if args.rehearse:
            config = rehearsal_config(config, Path(args.artifact_root or DEFAULT_REHEARSAL_ROOT).expanduser().resolve())
        elif args.artifact_root:
            os.environ["RLHF_ARTIFACT_ROOT"] = args.artifact_root  # the flag beats the environment
            overrides = {"artifact_root": args.artifact_root}
            if config.tiny_assets_dir is not None and "://" not in args.artifact_root:
                # Everything this run writes goes under the folder given.
                overrides["tiny_assets_dir"] = str(Path(args.artifact_root) / "tiny-assets")
            config = load_pipeline_config(args.preset, overrides)
    except ConfigError as error:
        parser.error(str(error))
    if args.plan:
        return plan(config)

    # The embedded server would report usage to Prefect; offline machines log an error for each attempt.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.settings import PREFECT_HOME

    from flows.full_rlhf import full_rlhf

    started = time.monotonic()
    state = full_rlhf(config, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    api = os.environ.get("PREFECT_API_URL") or f"the temporary server; database in {PREFECT_HOME.value()}"
    print(f"\nPrefect flow run {flow_run_id} ({api})")
    if not state.is_completed():
        print(f"full-rlhf {state.type.value.lower()}: {state.message}", file=sys.stderr)
        return 1
    result: PipelineResult = state.result()
    print(f"artifacts: {result.artifact_root}/{config.name}   workspaces: {get_settings().workspace_root}")
    if result.unchanged:
        print("nothing changed since the last run (config, data, code): every stage reused, no Ray job submitted")
    verdict = "promoted to production" if result.promotion.promoted else "NOT promoted"
    print(f"policy {result.promotion.stage} v{result.promotion.version}: {verdict}")
    print("\n".join(f"  {line}" for line in result.promotion.reasons))
    print(f"evaluation report: {result.report.uri}/report.md\n")
    print(metrics_table(result))
    if args.rehearse:
        print(f"\nrehearsal of {config.name} completed in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
