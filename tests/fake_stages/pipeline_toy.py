"""Toy stand-ins for every pipeline stage, for tests of the flow's orchestration (shapes, reuse, the gate) that need
no ML: `python -m tests.fake_stages.<stage> --config cfg.yaml --save_path OUT [--ckpt_path CKPT]`, with the real
stage's config (its resolved YAML, as run_stage writes it).

A trained stage writes model.json: the stage, the config fields naming models and data, and a "quality" that is the
quality of the model it starts from (0 for a model the config names) plus 1000 × its learning rate. The
evaluation writes the quality of the policy, reference and production models (read from their model.json) / 10 as
accuracy, reference_accuracy and production_accuracy, and a kl_mean, so the gate has numbers to compare.
"""

import argparse
import json
from pathlib import Path

import yaml

from stages.fields import path_fields
from stages.registry import STAGES

LEARNING_RATE_FIELDS = ("learning_rate", "actor_learning_rate")


def quality_of(model: str | None) -> float:
    """A toy model's quality: from its model.json (an artifact URI or path), 0 for anything else."""
    if not model:
        return 0.0
    path = Path(model.removeprefix("file://")) / "model.json"
    return json.loads(path.read_text())["quality"] if path.exists() else 0.0


def main(stage: str) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--save_path", required=True)
    parser.add_argument("--ckpt_path")
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    out = Path(args.save_path)
    out.mkdir(parents=True, exist_ok=True)
    inputs = {field: cfg[field] for field in sorted(path_fields(STAGES[stage])) if cfg.get(field)}
    print(f"toy {stage}: {json.dumps(inputs, sort_keys=True)}", flush=True)
    if stage == "evaluate":
        metrics = {"accuracy": quality_of(cfg["pretrain"]) / 10, "kl_mean": 0.1, "prompts": 16}
        for prefix, field in (("reference", "ref_pretrain"), ("production", "production_pretrain")):
            if cfg.get(field):
                metrics[f"{prefix}_accuracy"] = quality_of(cfg[field]) / 10
    else:
        learning_rate = next(cfg[field] for field in LEARNING_RATE_FIELDS if field in cfg)
        quality = quality_of(cfg.get("pretrain")) + 1000 * learning_rate
        (out / "model.json").write_text(json.dumps({"stage": stage, "quality": quality, **inputs}))
        metrics = {"quality": quality}
    (out / "metrics.json").write_text(json.dumps(metrics))
    print(f"toy {stage}: done {json.dumps(metrics)}", flush=True)
