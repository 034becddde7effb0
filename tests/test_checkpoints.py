"""Checkpoints belong to the run that wrote them: a run resumes only from checkpoints of its own fingerprint."""

from __future__ import annotations

import json
import re

import pytest

from stages.cli import parse_stage_args
from stages.engine import FINGERPRINT_FILE, claim_checkpoints, commit_checkpoint, training_fingerprint
from stages.errors import StageInputError
from stages.registry import STAGES


def sft_config(tmp_path, *flags: str):
    data = tmp_path / "sft.jsonl"
    if not data.exists():
        data.write_text('{"prompt": "1 + 1 = ?", "response": "Answer: 2"}\n')
    return parse_stage_args(STAGES["sft"], ["--config", "tiny", "--pretrain", "org/model", "--dataset", str(data),
                                    "--ckpt_path", str(tmp_path / "ckpt"), *flags])


def test_a_fresh_directory_is_claimed_and_a_matching_run_resumes(tmp_path):
    cfg = sft_config(tmp_path)
    assert claim_checkpoints("sft", cfg) == 0
    assert json.loads((tmp_path / "ckpt" / FINGERPRINT_FILE).read_text()) == training_fingerprint("sft", cfg)
    commit_checkpoint(tmp_path / "ckpt", 50, max_keep=2)
    # Logging, checkpoint cadence and output location do not change what is trained.
    same_run = sft_config(tmp_path, "--logging_steps", "7", "--save_steps", "25", "--save_path", str(tmp_path / "o"))
    assert claim_checkpoints("sft", same_run) == 50


def test_checkpoints_of_another_run_are_refused_naming_what_differs(tmp_path):
    claim_checkpoints("sft", sft_config(tmp_path))
    commit_checkpoint(tmp_path / "ckpt", 50, max_keep=2)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "1 + 1 = ?", "response": "Answer: 3"}\n')  # same path, new data
    other = sft_config(tmp_path, "--learning_rate", "0.1", "--pretrain", "org/other-model")
    with pytest.raises(StageInputError) as error:
        claim_checkpoints("sft", other)
    message = str(error.value)
    assert "holds checkpoints (step 50) of another run" in message
    assert "--learning_rate 0.002 -> 0.1" in message and "--pretrain 'org/model' -> 'org/other-model'" in message
    assert "content of --dataset (sha256:" in message and "--load_checkpoint" in message


def test_load_checkpoint_resumes_anyway_and_the_directory_changes_hands(tmp_path, capsys):
    claim_checkpoints("sft", sft_config(tmp_path))
    commit_checkpoint(tmp_path / "ckpt", 50, max_keep=2)
    on_purpose = sft_config(tmp_path, "--learning_rate", "0.1", "--load_checkpoint")
    assert claim_checkpoints("sft", on_purpose) == 50
    assert "--load_checkpoint: resuming from step 50 of a run that differed: --learning_rate" in capsys.readouterr().out
    # The directory now belongs to the new run: it resumes without the flag.
    assert claim_checkpoints("sft", sft_config(tmp_path, "--learning_rate", "0.1")) == 50


def test_checkpoints_without_a_fingerprint_are_not_trusted(tmp_path):
    (tmp_path / "ckpt").mkdir()
    commit_checkpoint(tmp_path / "ckpt", 10, max_keep=2)
    with pytest.raises(StageInputError, match="no fingerprint.json"):
        claim_checkpoints("sft", sft_config(tmp_path))


class Planted:
    """What a job could leave in a checkpoint folder: unpickling it creates a file (it could run anything)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_the_rng_state_round_trips_through_weights_only_and_a_planted_pickle_is_never_loaded(tmp_path):
    import random

    import numpy as np
    import torch

    from stages.engine import load_rng_state, rng_state, set_rng_state

    path = tmp_path / "rng_rank0.pt"
    torch.save(rng_state(), path)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(load_rng_state(path))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected

    marker = tmp_path / "planted-code-ran"
    torch.save({"python": Planted(marker)}, path)
    with pytest.raises(StageInputError, match="not an RNG state this project writes"):
        load_rng_state(path)
    assert not marker.exists()


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_a_planted_checkpoint_pickle_is_refused_before_deepspeed_loads_anything(assets, one_deepspeed_rank, tmp_path,
                                                                                zero_stage):
    """DeepSpeed loads model and optimizer states with torch.load(weights_only=False): a file replaced or added in
    the workspace (shared by every run of the stage key) ran its code on resume. Each file's sha256 is recorded
    when saved, and each file's pickle is read for what it would construct; a replaced file (its sum rewritten or
    not), a file added where DeepSpeed's loader looks, or a checkpoint without checksums is refused, naming the
    file, before any is loaded."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoModelForCausalLM

    from stages import engine as ds

    cfg = SimpleNamespace(zero_stage=zero_stage, bf16=False, max_norm=1.0, adam_offload=False,
                          gradient_checkpointing=False, lr_scheduler="constant", lr_warmup_ratio=0.0,
                          adam_betas=(0.9, 0.95), l2=0.0)
    ds_config = ds.deepspeed_config(cfg, world_size=1, train_batch_size=1, micro_batch_size=1)
    model = ds.load_for_zero(lambda: AutoModelForCausalLM.from_pretrained(assets["model"]), ds_config)
    engine = ds.build_train_engine(model, cfg, ds_config, learning_rate=1e-3, total_steps=2)
    ckpt = tmp_path / "ckpt"
    ds.save_checkpoint(engine, ckpt, 1, {"history": [1.0]})
    folder = ds.step_dir(ckpt, 1) / "model"
    recorded = json.loads((folder / "SHA256SUMS.rank0.json").read_text())
    states = sorted(name for name in recorded if name.endswith("_states.pt"))
    assert states and "rng_rank0.pt" not in recorded
    assert ds.load_checkpoint(engine, ckpt, 1)["history"] == [1.0]

    marker = tmp_path / "planted-code-ran"
    original = (folder / states[0]).read_bytes()
    torch.save({"module": Planted(marker)}, folder / states[0])
    with pytest.raises(StageInputError, match=f"nothing of it was loaded: {re.escape(states[0])}: its pickle "
                                              f"constructs io.open, which could run code; {re.escape(states[0])}"
                                              ": sha256 differs"):
        ds.load_checkpoint(engine, ckpt, 1)
    assert not marker.exists()
    # Whoever can plant a file in the workspace can rewrite its sum too: the pickle itself is refused.
    rewritten = {**recorded, states[0]: ds._sha256(folder / states[0])}
    (folder / "SHA256SUMS.rank0.json").write_text(json.dumps(rewritten))
    with pytest.raises(StageInputError, match=f"loaded: {re.escape(states[0])}: its pickle constructs io.open"):
        ds.load_checkpoint(engine, ckpt, 1)
    assert not marker.exists()
    (folder / "SHA256SUMS.rank0.json").write_text(json.dumps(recorded))
    (folder / states[0]).write_bytes(original)
    extra = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # where DeepSpeed's ZeRO loader globs
    torch.save({"optimizer_state_dict": Planted(marker)}, extra)
    with pytest.raises(StageInputError, match=f"{re.escape(extra.name)}: not in the checksums"):
        ds.load_checkpoint(engine, ckpt, 1)
    extra.unlink()
    for sums in folder.glob("SHA256SUMS.rank*.json"):
        sums.unlink()
    with pytest.raises(StageInputError, match="no checksums"):
        ds.load_checkpoint(engine, ckpt, 1)
    assert not marker.exists()
    # What the check stands between: DeepSpeed itself unpickles a replaced states file.
    torch.save({"module": Planted(marker)}, folder / states[0])
    with pytest.raises(Exception):
        engine.load_checkpoint(str(ds.step_dir(ckpt, 1)), tag="model")
    assert marker.exists()


def _record_over_two_ranks(rank: int, folder: str, store_path: str, results) -> None:
    """Rank 1 leaves its temporary sums file in the folder a while; rank 0 lists the folder late."""
    import os
    import time
    from pathlib import Path

    import torch.distributed as dist

    from stages import engine as ds

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    if rank == 0:
        listing = ds._unpickled_files
        ds._unpickled_files = lambda path: (time.sleep(0.5), listing(path))[1]
    else:
        replace = os.replace
        ds.os.replace = lambda src, dst: (time.sleep(1.0), replace(src, dst))[1]
    ds._record_checksums(Path(folder))
    try:
        ds._verify_checksums(Path(folder))
        results[rank] = "verified"
    except StageInputError as error:
        results[rank] = str(error)
    dist.destroy_process_group()


def test_checksums_list_the_checkpoint_not_another_ranks_temporary_file(tmp_path):
    """Every rank lists the folder before any writes its sums into it: a rank that listed late once recorded another
    rank's temporary file, which was gone by the time the checkpoint was verified (a nightly reward model failed)."""
    import torch
    import torch.multiprocessing as mp

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        torch.save({"name": name}, folder / name)
    results = mp.Manager().dict()
    mp.spawn(_record_over_two_ranks, args=(str(folder), str(tmp_path / "store"), results), nprocs=2)
    assert dict(results) == {0: "verified", 1: "verified"}
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == []


def test_workspace_files_are_replaced_whole_never_written_through_a_planted_link(tmp_path):
    """The workspace is shared by every job of the stage key: a symlink left at the old predictable temporary name
    (latest_step.json.tmp) or at the file itself is never written through."""
    from stages.engine import LATEST_MARKER, write_replacing

    outside = tmp_path / "outside.txt"
    outside.write_text("kept")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / f"{LATEST_MARKER}.tmp").symlink_to(outside)
    write_replacing(ckpt / LATEST_MARKER, '{"step": 3}')
    assert json.loads((ckpt / LATEST_MARKER).read_text()) == {"step": 3} and outside.read_text() == "kept"
    (ckpt / LATEST_MARKER).unlink()
    (ckpt / LATEST_MARKER).symlink_to(outside)
    write_replacing(ckpt / LATEST_MARKER, '{"step": 4}')
    assert not (ckpt / LATEST_MARKER).is_symlink() and outside.read_text() == "kept"
    assert sorted(p.name for p in ckpt.iterdir()) == [LATEST_MARKER, f"{LATEST_MARKER}.tmp"]  # nothing left behind
