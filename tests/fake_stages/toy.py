"""A stage that keeps the stage contract without any ML: `python -m tests.fake_stages.toy --config cfg.yaml
--save_path OUT --ckpt_path CKPT`.

Config fields: value (int), pretrain (an input URI or null), sleep_s (seconds to run), config_error (bool:
exit 2 naming the field), steps (step lines to print, in the stages' progress format), leak_env (names of
variables whose values it prints, as a careless library would; with no checkpoint yet it also fails with them in
its error), nan_until_resumed (bool: a NaN metric when no checkpoint existed at start). It checkpoints step 1, crashes (exit 3) after that checkpoint when TOY_CRASH_AFTER_CHECKPOINT is set
and none existed at start, and writes result.json and metrics.json.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--save_path", required=True)
    parser.add_argument("--ckpt_path", required=True)
    args = parser.parse_args()
    cfg = yaml.safe_load(Path(args.config).read_text())
    print(f"toy: starting with value={cfg['value']} pretrain={cfg.get('pretrain')}", flush=True)
    if cfg.get("config_error"):
        print(f"toy: error: {args.config}: field 'value' = {cfg['value']} is not allowed", file=sys.stderr)
        sys.exit(2)

    step_file = Path(args.ckpt_path) / "step"
    resumed_from_step = int(step_file.read_text()) if step_file.exists() else 0
    step_file.parent.mkdir(parents=True, exist_ok=True)
    step_file.write_text("1")
    print(f"toy: checkpoint step 1 written (resumed_from_step={resumed_from_step})", flush=True)
    if os.environ.get("TOY_CRASH_AFTER_CHECKPOINT") and resumed_from_step == 0:
        print("toy: fault injected after checkpoint", file=sys.stderr, flush=True)
        sys.exit(3)

    leaked = " ".join(f"{name}={os.environ.get(name)}" for name in cfg.get("leak_env") or [])
    if leaked:
        print(f"toy: environment {leaked}", flush=True)
        if resumed_from_step == 0:
            print(f"toy: error: could not authenticate with {leaked}", file=sys.stderr, flush=True)
            sys.exit(1)

    steps = int(cfg.get("steps", 0))
    for step in range(1, steps + 1):
        print(f"[toy] step {step}/{steps} ({100 * step // steps}%, elapsed 0:00:{step:02d}, "
              f"ETA 0:00:{steps - step:02d}) value={cfg['value']} loss={1 / step:.4f}", flush=True)
        time.sleep(0.2)
    time.sleep(float(cfg.get("sleep_s", 0)))
    out = Path(args.save_path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps({"value": cfg["value"], "pretrain": cfg.get("pretrain")}))
    metrics = {"value": cfg["value"], "resumed_from_step": resumed_from_step}
    if steps:
        metrics["steps"] = steps
    if cfg.get("nan_until_resumed") and resumed_from_step == 0:
        metrics["loss"] = float("nan")
    (out / "metrics.json").write_text(json.dumps(metrics))
    print("toy: done", flush=True)


if __name__ == "__main__":
    main()
