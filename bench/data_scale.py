"""Data at the seed's scale: how long a stage takes from its start to its first training step, and how much memory
its processes hold, as the dataset grows; a first run (tokenizing) and a second over the same data (the cache).

    python -m bench --data                              # 10k, 100k and 700k preference pairs, 1M SFT rows
    python -m bench --data --pairs 10000 --sft_rows 0   # one size, no SFT case

Pairs are synthetic rows in OpenRLHF/preference_dataset_mixture2_and_safe_pku's layout (chosen and rejected whole
conversations: a user turn of 20-90 words, answers of 60-200 words); SFT rows are OpenOrca-like question/response
pairs. The reward model (or SFT) stage runs on the tiny preset's settings with --max_len 512 and is stopped at its
first step. Memory is the peak, sampled every second (a finer sampling costs the stage CPU), of the summed memory
of the stage's driver and its rank processes (and the processes they start): resident (RSS: memory-mapped data files
count where their pages are in the page cache, once per process that reads them) and private (RSS less file-backed
and shared pages: what the processes allocated).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil

MAX_LEN = 512
FIRST_STEP = re.compile(r"\[(?:reward_model|sft)\] step 1/")
PREPARED = re.compile(r"training rows: (?P<examples>\d+) examples of (?P<rows>\d+) rows (?P<how>tokenized in "
                      r"(?P<seconds>[\d.]+) s \((?P<rate>\d+) rows/s|from the cache)")


def words(rng: np.random.Generator, count: int) -> np.ndarray:
    """A vocabulary of `count` lowercase words of 2-9 letters, drawn with English-like letter frequencies."""
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    weights = 1 / np.arange(1, 27) ** 0.9
    lengths = rng.integers(2, 10, count)
    drawn = rng.choice(letters, size=int(lengths.sum()), p=weights / weights.sum())
    return np.array(["".join(part) for part in np.split(drawn, np.cumsum(lengths)[:-1])])


class TextSource:
    """Texts of a given number of words, cut from one long stream of random words (fast for millions of rows)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        vocabulary = words(self.rng, 5_000)
        self.stream = vocabulary[self.rng.integers(0, len(vocabulary), 2_000_000)].tolist()

    def text(self, low: int, high: int) -> str:
        length = int(self.rng.integers(low, high + 1))
        start = int(self.rng.integers(0, len(self.stream) - length))
        return " ".join(self.stream[start : start + length]).capitalize() + "."


def write_pairs(path: Path, rows: int, seed: int = 0) -> Path:
    source = TextSource(seed)
    with path.open("w") as out:
        for _ in range(rows):
            user = {"role": "user", "content": source.text(20, 90)}
            pair = {side: [user, {"role": "assistant", "content": source.text(60, 200)}]
                    for side in ("chosen", "rejected")}
            out.write(json.dumps({**pair, "chosen_score": 1.0, "rejected_score": 0.0}) + "\n")
    return path


def write_sft_rows(path: Path, rows: int, seed: int = 0) -> Path:
    source = TextSource(seed)
    with path.open("w") as out:
        for index in range(rows):
            out.write(json.dumps({"id": f"synthetic.{index}", "system_prompt": "", "question": source.text(20, 90),
                                  "response": source.text(60, 200)}) + "\n")
    return path


def stage_processes(driver: psutil.Process, rank_name: str) -> list[psutil.Process]:
    found = [driver, *driver.children(recursive=True)]
    for process in psutil.process_iter(["cmdline"]):
        if process.info["cmdline"] and process.info["cmdline"][0].startswith(f"ray::{rank_name}"):
            found += [process, *process.children(recursive=True)]
    return found


def until_first_step(command: list[str], env: dict, cwd: Path, rank_name: str) -> dict:
    """Run `command` until it logs its first training step; its seconds to it, its processes' peak memory and
    what the stage said about preparing its examples."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    driver, peak, lines, done = psutil.Process(proc.pid), [0, 0], [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            resident = private = 0
            for process in stage_processes(driver, rank_name):
                try:
                    memory = process.memory_info()
                except psutil.Error:
                    continue
                resident, private = resident + memory.rss, private + memory.rss - memory.shared
            peak[0], peak[1] = max(peak[0], resident), max(peak[1], private)
            time.sleep(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    seconds = None
    for line in proc.stdout:
        lines.append(line)
        if FIRST_STEP.search(line):
            seconds = time.perf_counter() - started
            break
    done.set()
    sampler.join()
    proc.kill()
    proc.wait()
    if seconds is None:
        raise RuntimeError(f"{' '.join(command)} ended before its first step:\n{''.join(lines[-60:])}")
    prepared = next((match for line in lines if (match := PREPARED.search(line))), None)
    return {"seconds_to_first_step": round(seconds, 1), "peak_memory_gib": round(peak[0] / 2**30, 2),
            "peak_private_memory_gib": round(peak[1] / 2**30, 2),
            "cached": bool(prepared and prepared["how"].startswith("from the cache")),
            "tokenize_seconds": float(prepared["seconds"]) if prepared and prepared["seconds"] else None,
            "tokenize_rows_per_s": int(prepared["rate"]) if prepared and prepared["rate"] else None}


def measure(work: Path, model: str, env: dict, cwd: Path, pairs: list[int], sft_rows: list[int]) -> dict:
    cases = [("reward_model", "RewardModelWorker", rows, write_pairs, ("--prompt_key", "none")) for rows in pairs]
    cases += [("sft", "SFTWorker", rows, write_sft_rows, ("--input_key", "question", "--output_key", "response",
                                                          "--system_key", "system_prompt")) for rows in sft_rows]
    results = []
    cache = work / "hf-datasets"  # the datasets' Arrow copies and the prepared examples, removed after each case
    env = {**env, "HF_DATASETS_CACHE": str(cache)}
    for stage, rank_name, rows, write, flags in cases:
        path = work / f"{stage}-{rows}.jsonl"
        started = time.perf_counter()
        write(path, rows)
        written = time.perf_counter() - started
        command = [sys.executable, "-m", f"stages.{stage}", "--config", "tiny", "--pretrain", model, "--dataset",
                   str(path), "--max_len", str(MAX_LEN), "--max_samples", str(rows), "--logging_steps", "1",
                   "--save_path", str(work / f"{stage}-{rows}-out"), *flags]
        runs = []
        for _ in ("first", "second"):
            runs.append(until_first_step([*command, "--ckpt_path", str(work / f"{stage}-{rows}-ckpt-{len(runs)}")],
                                         env, cwd, rank_name))
        results.append({"stage": stage, "rows": rows, "file_gib": round(path.stat().st_size / 2**30, 2),
                        "write_seconds": round(written, 1), "first": runs[0], "second": runs[1]})
        print(row_of(results[-1]), flush=True)
        path.unlink()
        shutil.rmtree(cache, ignore_errors=True)
    return {"max_len": MAX_LEN, "cases": results}


HEADER = ("| stage | rows | file | first run: to first step | tokenized rows/s | peak memory: resident, private | "
          "second run: to first step | peak memory: resident, private |\n|---|---|---|---|---|---|---|---|")


def row_of(case: dict) -> str:
    first, second = case["first"], case["second"]
    return (f"| {case['stage']} | {case['rows']:,} | {case['file_gib']} GiB | {first['seconds_to_first_step']} s | "
            f"{first['tokenize_rows_per_s'] or '-'} | "
            f"{first['peak_memory_gib']}, {first['peak_private_memory_gib']} GiB | "
            f"{second['seconds_to_first_step']} s{' (cache)' if second['cached'] else ''} | "
            f"{second['peak_memory_gib']}, {second['peak_private_memory_gib']} GiB |")


def table(results: dict) -> str:
    return "\n".join([HEADER, *map(row_of, results["cases"])])
