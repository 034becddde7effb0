"""The embedded default: run the full-rlhf flow in this process on one machine.

    python -m flows.run --preset tiny [--artifact_root DIR]

Without PREFECT_API_URL, Prefect starts a temporary local server for the run (its database stays in
PREFECT_HOME, so `prefect server start` shows the run afterwards). Without RLHF_RAY_ADDRESS, the flow starts
a local Ray head and stops it at the end. With `tiny_assets_dir` in the preset (tiny does), the tiny model and
datasets are built there first. Exits non-zero when the run fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefect.settings import PREFECT_HOME

from flows.full_rlhf import full_rlhf
from flows.results import PipelineResult
from infra.settings import get_settings
from stages.config import ConfigError, load_pipeline_config, preset_names


def metrics_table(result: PipelineResult) -> str:
    """One row per stage: version, digest and its metrics."""
    lines = [f"{'stage':<13} {'version':<8} {'digest':<13} metrics"]
    for stage, artifact in result.stages.items():
        metrics = ", ".join(
            f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
            for name, value in sorted(artifact.metrics.items())
        )
        lines.append(f"{stage:<13} v{artifact.version:<7} {artifact.digest[:12]:<13} {metrics}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the full-rlhf flow in-process (local Prefect, local Ray).")
    parser.add_argument("--preset", default="tiny", help=f"preset name ({', '.join(preset_names())}) or YAML path")
    parser.add_argument(
        "--artifact_root",
        help="artifact store root (path, file:// or s3://); default: the preset's. A local one also holds the "
        "tiny assets (<root>/tiny-assets) when the preset builds them",
    )
    args = parser.parse_args(argv)

    try:
        config = load_pipeline_config(args.preset)
        if args.artifact_root:
            os.environ["RLHF_ARTIFACT_ROOT"] = args.artifact_root  # the flag beats the environment
            overrides = {"artifact_root": args.artifact_root}
            if config.tiny_assets_dir is not None and "://" not in args.artifact_root:
                # Everything this run writes goes under the folder given.
                overrides["tiny_assets_dir"] = str(Path(args.artifact_root) / "tiny-assets")
            config = load_pipeline_config(args.preset, overrides)
    except ConfigError as error:
        parser.error(str(error))

    state = full_rlhf(config, return_state=True)
    flow_run_id = state.state_details.flow_run_id
    api = os.environ.get("PREFECT_API_URL") or f"the temporary server; database in {PREFECT_HOME.value()}"
    print(f"\nPrefect flow run {flow_run_id} ({api})")
    if not state.is_completed():
        print(f"full-rlhf {state.type.value.lower()}: {state.message}", file=sys.stderr)
        return 1
    result: PipelineResult = state.result()
    print(f"artifacts: {result.artifact_root}/{config.name}   workspaces: {get_settings().workspace_root}")
    verdict = "promoted to production" if result.promotion.promoted else "NOT promoted"
    print(f"policy rl v{result.promotion.version}: {verdict} ({'; '.join(result.promotion.reasons)})")
    print(f"evaluation report: {result.report.uri}/report.md\n")
    print(metrics_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
