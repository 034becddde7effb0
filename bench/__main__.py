"""Benchmark harness: the RL stage side by side with TRL's GRPOTrainer, the supervised stages' tokens/s and the
tiny pipeline end to end, all in one run on this machine.

    python -m bench                      # full: tiny and ~18M-parameter models, 25 and 5 steps, pipeline
    python -m bench --quick              # tiny model, 2 steps, SFT alone, no pipeline (what the test runs)
    python -m bench --rl_only            # the full RL cases alone (no supervised stages, no pipeline)
    python -m bench --rl_only --case tiny --seeds 16   # one RL case alone, its accuracy over 16 seeds
    python -m bench --data               # time to the first step and memory on 10k-700k pairs (bench/data_scale.py)

Our RL stage also runs with --async_train (rollouts one step ahead) beside a synchronous run on the same placement
(the full bench; the quick one compares with the hybrid-engine run): loop seconds, accuracy, and how much of the
loop generation and reward took, which async overlaps with training.

Both RL sides get the same model, prompts, rule reward and budget: GRPO, 32 prompts x 4 samples per step, one
optimizer step per rollout, learning rate 3e-4, KL 0.01 (k3, in the loss), temperature 1, and the same seeds: the
held-out accuracy of the tiny case is the mean over its seeds (one run is too noisy to rank two trainers). TRL runs
where `trl` is installed (the `bench` extra) and is skipped otherwise. Prints a table of ratios and writes it as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import data_scale
from infra.ray_cluster import LocalRayHead
from stages.tiny import TinyModelShape, build_tiny_assets, build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
# ~18M parameters: the size where generation starts to dominate on two cores.
MEDIUM_SHAPE = TinyModelShape(hidden_size=512, intermediate_size=1376, num_hidden_layers=6, num_attention_heads=8,
                              num_key_value_heads=4, max_position_embeddings=128)


@dataclass(frozen=True)
class RLCase:
    name: str
    model: str  # "sft" (the tiny preset's SFT) or "medium" (random ~18M Llama)
    steps: int
    new_tokens: int
    rollout_backend: str  # the tiny preset's HF generate, or vLLM where generation is most of the work
    # Both sides train once per seed; the speed rows come from the first seed's runs, accuracy is the mean over all.
    seeds: tuple[int, ...] = (42,)


FULL_CASES = (RLCase("tiny", "sft", 25, 8, "hf", seeds=(42, 43, 44)), RLCase("medium", "medium", 5, 64, "vllm"))
QUICK_CASES = (RLCase("tiny", "base", 2, 8, "hf"),)
PROMPTS_PER_STEP, SAMPLES_PER_PROMPT, LEARNING_RATE, KL_COEF = 32, 4, 3e-4, 0.01


# Our stages join one Ray head, as the jobs of a pipeline join their cluster (a stage run alone would first start a
# private one, about 4 s more).
RAY_ENV: dict[str, str] = {}


def env(joins_ray: bool = True) -> dict[str, str]:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": str(ROOT),
            "TOKENIZERS_PARALLELISM": "false", **(RAY_ENV if joins_ray else {})}


def timed(command: list[str], joins_ray: bool = True) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env(joins_ray), capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return seconds, proc


def stage(name: str, *flags) -> tuple[float, dict]:
    seconds, _ = timed([sys.executable, "-m", f"stages.{name}", "--config", "tiny", *map(str, flags)])
    save_path = Path(flags[list(flags).index("--save_path") + 1])
    return seconds, json.loads((save_path / "metrics.json").read_text())


# Async beside sync on the same placement: async cannot share the actor's GPUs with the engines (hybrid engine).
VARIANTS = {"sync": (), "separate": ("--no_colocate_all_models",),
            "async": ("--no_colocate_all_models", "--async_train", "--async_queue_size", 1)}


def ours_rl(case: RLCase, model: str, assets: dict, work: Path, variant: str = "sync", seed: int | None = None) -> dict:
    seed = case.seeds[0] if seed is None else seed
    out = work / f"rl-{case.name}-{variant}-{seed}"
    wall, metrics = stage(
        "rl", "--pretrain", model, "--remote_rm_url", "stages/tiny_reward.py", "--prompt_data", assets["prompts_train"],
        "--eval_dataset", assets["prompts_eval"], "--eval_n_samples_per_prompt", 0,
        "--advantage_estimator", "group_norm", "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", KL_COEF,
        "--rollout_batch_size", PROMPTS_PER_STEP, "--n_samples_per_prompt", SAMPLES_PER_PROMPT,
        "--train_batch_size", PROMPTS_PER_STEP * SAMPLES_PER_PROMPT, "--actor_learning_rate", LEARNING_RATE,
        "--generate_max_len", case.new_tokens, "--max_samples", PROMPTS_PER_STEP * case.steps,
        "--rollout_backend", case.rollout_backend, "--seed", seed,
        "--save_path", out / "model", "--ckpt_path", out / "ckpt", *VARIANTS[variant],
    )
    phases = {k.removeprefix("seconds/"): v for k, v in metrics.items() if k.startswith("seconds/")}
    startup = {k.removeprefix("startup/"): v for k, v in metrics.items() if k.startswith("startup/")}
    return {"command_seconds": wall, "startup_seconds": metrics["startup_seconds"], "startup": startup,
            "loop_seconds": metrics["train_seconds"],
            "samples_per_s": PROMPTS_PER_STEP * SAMPLES_PER_PROMPT * case.steps / metrics["train_seconds"],
            "eval_accuracy": metrics.get("eval_reward"), "phases": phases,
            "train_rewards": [row["reward"] for row in json.loads((out / "model" / "history.json").read_text())],
            # Work that ran on the engines beside the training loop (async), as a share of the loop's seconds.
            "generation_share": (phases.get("generation", 0) + phases.get("reward", 0)) / metrics["train_seconds"]}


def trl_installed() -> bool:
    return importlib.util.find_spec("trl") is not None


def trl_rl(case: RLCase, model: str, assets: dict, work: Path, seed: int | None = None) -> dict | None:
    if not trl_installed():
        return None
    seed = case.seeds[0] if seed is None else seed
    args = {"model": model, "prompts": str(assets["prompts_train"]), "eval_prompts": str(assets["prompts_eval"]),
            "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES_PER_PROMPT, "steps": case.steps,
            "new_tokens": case.new_tokens, "learning_rate": LEARNING_RATE, "kl_coef": KL_COEF, "seed": seed,
            "output_dir": str(work / f"trl-{case.name}-{seed}")}
    args_path, out_path = work / f"trl-{case.name}-{seed}.json", work / f"trl-{case.name}-{seed}-result.json"
    args_path.write_text(json.dumps(args))
    wall, _ = timed([sys.executable, "-m", "bench.trl_grpo", str(args_path), str(out_path)])
    return {"command_seconds": wall, **json.loads(out_path.read_text())}


def same_batch(model: str, assets: dict, work: Path) -> dict | None:
    """One update of both sides on one sampled batch (bench/same_batch.py): where the trainers differ without the
    sampling noise of the accuracy rows."""
    if not trl_installed():
        return None
    out = work / "same-batch.json"
    timed([sys.executable, "-m", "bench.same_batch", "--model", model, "--prompts", assets["prompts_train"],
           "--out", str(out)])
    return json.loads(out.read_text())


SUPERVISED = (("sft", "sft_train"), ("reward_model", "pref_train"), ("dpo", "pref_train"))


def supervised(assets: dict, model: str, work: Path, steps: int, stages=SUPERVISED) -> dict:
    """Tokens/s of supervised stages on the tiny task (the tiny preset on 2 ranks, data parallel), over `steps`
    optimizer steps."""
    results = {}
    for name, dataset in stages:
        out = work / f"{name}-speed"
        _, metrics = stage(name, "--pretrain", model, "--dataset", assets[dataset], "--max_epochs", 1,
                           "--max_samples", 32 * steps, "--num_gpus_per_node", 2, "--save_path", out / "model",
                           "--ckpt_path", out / "ckpt")
        results[name] = {"tokens_per_s": metrics["tokens_per_second"], "step_seconds": metrics["seconds/step"] / steps}
    return results


def pipeline(work: Path) -> dict:
    # As a user runs it: the flow starts its own head.
    wall, _ = timed([sys.executable, "-m", "flows.run", "--preset", "tiny", "--artifact_root", str(work / "artifacts")],
                    joins_ray=False)
    return {"command_seconds": wall}


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "platform": platform.platform()}


def table(results: dict) -> str:
    lines = ["| measurement | this project | TRL GRPOTrainer | ratio (ours / TRL, higher is better for us) |",
             "|---|---|---|---|"]
    for name, case in results["rl"].items():
        ours, theirs = case["ours"], case.get("trl")
        accuracy = case["accuracy"]
        seeds = f"mean of {len(accuracy['ours'])} seed{'s' * (len(accuracy['ours']) > 1)}: " + " / ".join(
            f"{_fmt(mine)} vs {_fmt(other)}" for mine, other in zip(accuracy["ours"], accuracy["trl"]))
        rows = [("training loop samples/s", ours["samples_per_s"], theirs and theirs["samples_per_s"], False),
                ("training loop seconds", ours["loop_seconds"], theirs and theirs["loop_seconds"], True),
                ("whole command seconds", ours["command_seconds"], theirs and theirs["command_seconds"], True),
                (f"held-out greedy accuracy ({seeds})", _mean(accuracy["ours"]), theirs and _mean(accuracy["trl"]),
                 False)]
        for label, mine, other, lower_is_better in rows:
            ratio = "" if not other or mine is None else f"{(other / mine if lower_is_better else mine / other):.2f}x"
            lines.append(f"| {name}: {label} | {_fmt(mine)} | {_fmt(other) if theirs else 'not installed'} | "
                         f"{ratio} |")
        split = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in sorted(
            ours["phases"].items(), key=lambda item: -item[1]) if phase not in ("step", "experience") and seconds >= 0.05)
        lines.append(f"| {name}: loop seconds by phase ({split}) | {_fmt(ours['phases'].get('step'))} | | |")
        parts = ", ".join(f"{part} {seconds:.1f}" for part, seconds in ours["startup"].items())
        lines.append(f"| {name}: RL stage start-up seconds ({parts}) | {_fmt(ours['startup_seconds'])} | | |")
    lines += ["", "| measurement | synchronous | async (queue 1) | ratio (async / sync, higher is better for async) |",
              "|---|---|---|---|"]
    for name, case in results["rl"].items():
        sync, later = case.get("separate", case["ours"]), case["async"]
        placement = "separate placements" if "separate" in case else "sync hybrid engine, async separate"
        rows = [("training loop samples/s", "samples_per_s", False), ("training loop seconds", "loop_seconds", True),
                ("held-out greedy accuracy", "eval_accuracy", False),
                ("generation + reward seconds / loop seconds", "generation_share", False)]
        for label, key, lower_is_better in rows:
            mine, other = later[key], sync[key]
            ratio = "" if not other or mine is None else f"{(other / mine if lower_is_better else mine / other):.2f}x"
            lines.append(f"| {name} ({placement}): {label} | {_fmt(other)} | {_fmt(mine)} | {ratio} |")
        lines.append(f"| {name}: seconds the trainer waited for rollouts (async) | | "
                     f"{_fmt(later['phases'].get('rollout_wait'))} | |")
    if results.get("same_batch"):
        same = results["same_batch"]
        lines += ["", "| one GRPO update on the same sampled batch (tiny SFT model) | this project | TRL GRPOTrainer "
                  "| ratio |", "|---|---|---|---|"]
        for label, key in (("loss", "loss"), ("gradient norm", "gradient_norm")):
            lines.append(f"| {label} | {same[key]['ours']:.6g} | {same[key]['trl']:.6g} | "
                         f"{same[key]['ours'] / same[key]['trl']:.4f}x |")
        lines += [f"| gradient cosine similarity | {same['gradient_cosine']:.6f} | | |",
                  f"| largest advantage difference | {same['advantage_max_difference']:.2g} | | |",
                  "| largest parameter difference after one optimizer step (our DeepSpeed engine, torch AdamW) | "
                  f"{same['optimizer_step_max_parameter_difference']:.2g} | | |"]
    for name, result in results.get("supervised", {}).items():
        lines.append(f"| {name}: tokens/s (2 ranks) | {_fmt(result['tokens_per_s'])} | | |")
    if "pipeline" in results:
        lines.append(f"| tiny pipeline, whole command seconds | {_fmt(results['pipeline']['command_seconds'])} | | |")
    return "\n".join(lines)


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 steps, SFT alone, no pipeline")
    parser.add_argument("--rl_only", action="store_true", help="the RL cases alone: no supervised stages, no pipeline")
    parser.add_argument("--case", choices=[case.name for case in FULL_CASES], default=None,
                        help="only this RL case (default: all)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="train each RL case with this many seeds (42, 43, ...) for the accuracy row "
                             "(default: 3 for the tiny case, 1 otherwise)")
    parser.add_argument("--data", action="store_true",
                        help="data at scale alone: seconds to the first training step and peak memory per dataset size")
    parser.add_argument("--pairs", default="10000,100000,700000", help="with --data: preference pair counts")
    parser.add_argument("--sft_rows", default="1000000", help="with --data: SFT row counts (0: none)")
    parser.add_argument("--out", default=None,
                        help="where the JSON goes (default: bench/results.json, with --data bench/results-data.json)")
    parser.add_argument("--work_dir", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args(argv)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rlhf-bench-"))
    out = Path(args.out or ROOT / "bench" / ("results-data.json" if args.data else "results.json"))
    with LocalRayHead(auth_mode="disabled") as head:
        RAY_ENV.update(RAY_ADDRESS=head.gcs_address, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        if args.data:
            counts = {name: [int(n) for n in value.split(",") if int(n)] for name, value in
                      (("pairs", args.pairs), ("sft_rows", args.sft_rows))}
            model = str(build_tiny_model(work / "model", seed=0))
            results = {"machine": machine(), **data_scale.measure(work, model, env(), ROOT, **counts)}
            results["table"] = data_scale.table(results)
        else:
            results = measure(args.quick, work, rl_only=args.rl_only, case_name=args.case, seeds=args.seeds)
    out.write_text(json.dumps(results, indent=1))
    print(results["table"])
    print(f"\nwritten to {out} (machine: {results['machine']['cpus']} CPUs, {results['machine']['cpu']})")
    return 0


def measure(quick: bool, work: Path, rl_only: bool = False, case_name: str | None = None,
            seeds: int | None = None) -> dict:
    """Every measurement of the table, one after another."""
    assets = {k: str(v) for k, v in build_tiny_assets(work / "tiny").items()}
    models = {"base": assets["model"]}
    results: dict = {"machine": machine(), "quick": quick, "rl": {}}
    cases = [case for case in (QUICK_CASES if quick else FULL_CASES) if case_name in (None, case.name)]
    if seeds is not None:
        cases = [dataclasses.replace(case, seeds=tuple(range(42, 42 + seeds))) for case in cases]
    if any(case.model == "sft" for case in cases):
        seconds, _ = stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"],
                           "--save_path", work / "sft" / "model", "--ckpt_path", work / "sft" / "ckpt")
        models["sft"] = str(work / "sft" / "model")
        results["same_batch"] = same_batch(models["sft"], assets, work)
    if any(case.model == "medium" for case in cases):
        models["medium"] = str(build_tiny_model(work / "medium", seed=0, shape=MEDIUM_SHAPE))

    for case in cases:
        model = models[case.model]
        ours, theirs = ours_rl(case, model, assets, work), trl_rl(case, model, assets, work)
        accuracy = {"seeds": list(case.seeds), "ours": [ours["eval_accuracy"]],
                    "trl": [theirs and theirs["eval_accuracy"]]}
        for seed in case.seeds[1:]:
            accuracy["ours"].append(ours_rl(case, model, assets, work, seed=seed)["eval_accuracy"])
            other = trl_rl(case, model, assets, work, seed=seed)
            accuracy["trl"].append(other and other["eval_accuracy"])
        results["rl"][case.name] = {"case": case.__dict__, "ours": ours, "trl": theirs, "accuracy": accuracy}
        # Quick: async beside the hybrid sync run; full: also sync on async's placement, the fair comparison.
        for variant in ("async",) if quick else ("separate", "async"):
            results["rl"][case.name][variant] = ours_rl(case, model, assets, work, variant)
    if not rl_only:
        # Quick: SFT alone (the three stages share the measured loop; each costs a stage start-up).
        results["supervised"] = supervised(assets, models.get("sft", assets["model"]), work, steps=2 if quick else 20,
                                           stages=SUPERVISED[:1] if quick else SUPERVISED)
    if not (quick or rl_only):
        results["pipeline"] = pipeline(work)
    results["table"] = table(results)
    return results


if __name__ == "__main__":
    sys.exit(main())
