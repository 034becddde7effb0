"""Examples prepared once per node (stages/prepared.py): encoded in chunks over several processes, they equal the
stage's encoder on the whole dataset token for token (the supervised stages' examples and the RL and evaluation
stages' prompts); a second preparation of the same rows reads the cache, a changed row encodes again; dropped rows
are counted over the whole dataset."""

from __future__ import annotations

import json
import logging
import os
import time
from types import SimpleNamespace

import datasets
import pytest

from stages import data, prepared
from stages.cli import parse_stage_args
from stages.data import DataValidationError
from stages.dpo import train as dpo
from stages.environment import stage_environment
from stages.errors import StageInputError
from stages.kto import train as kto
from stages.registry import STAGES
from stages.reward_model import train as reward_model
from stages.rl.driver import PromptStream
from stages.sft import train as sft

# The RL and evaluation stages' prompts, encoded as the supervised stages' examples are.
prompts = SimpleNamespace(encode_rows=data.encode_prompt_rows, EXAMPLE_FIELDS=data.PROMPT_FIELDS)

# (stage, module, dataset, flags): every format the stages encode, as tests/test_formats.py reads them
FORMATS = [
    ("sft", sft, "sft_train", ()),
    ("sft", sft, "orca_train", ("--input_key", "question", "--output_key", "response", "--system_key",
                                "system_prompt")),
    ("sft", sft, "chat_train", ("--input_key", "messages", "--multiturn", "--max_len", "128")),
    ("sft", sft, "pretrain_train", ("--no_apply_chat_template", "--input_key", "text", "--pretrain_mode",
                                    "--max_len", "12")),
    ("reward_model", reward_model, "pref_train", ()),
    ("dpo", dpo, "pref_chat_train", ("--prompt_key", "none")),
    ("kto", kto, "kto_train", ()),
    ("kto", kto, "pref_train", ()),
    ("rl", prompts, "prompts_train", ("--prompt_max_len", "14")),  # some prompts are longer: dropped
    ("rl", prompts, "prompts_chat_train", ("--input_key", "context_messages")),
    ("evaluate", prompts, "prompts_eval", ("--no_apply_chat_template", "--input_template", "Q: {}\nA: ",
                                           "--label_key", "none")),
]


@pytest.fixture
def small_chunks(monkeypatch, tmp_path):
    """Chunks of 7 rows over 2 processes from 20 rows on, and a cache of this test's own."""
    monkeypatch.setattr(prepared, "BATCH_ROWS", 7)
    monkeypatch.setattr(prepared, "PARALLEL_FROM_ROWS", 20)
    monkeypatch.setenv("RLHF_CPU_CORES", "2")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def config(stage: str, source, *flags: str):
    data_flags = {"rl": ("--prompt_data", str(source), "--remote_rm_url", "stages/tiny_reward.py"),
                  "evaluate": ("--prompt_data", str(source), "--remote_rm_url", "stages/tiny_reward.py",
                               "--eval_suite", "none")}
    return parse_stage_args(STAGES[stage], ["--config", "tiny", "--pretrain", "unused",
                                            *data_flags.get(stage, ("--dataset", str(source))), *flags])


def prepare(module, cfg, tokenizer, rows, report: bool = True):
    return prepared.prepare(module.encode_rows, cfg, module.EXAMPLE_FIELDS, tokenizer, rows, report=report)


@pytest.mark.parametrize(("stage", "module", "dataset", "flags"), FORMATS,
                         ids=[f"{stage}-{dataset}" for stage, _, dataset, _ in FORMATS])
def test_prepared_examples_equal_the_encoder_on_the_whole_dataset(stage, module, dataset, flags, assets, tokenizer,
                                                                  small_chunks):
    cfg = config(stage, assets[dataset], *flags)
    rows = data.load_rows(str(assets[dataset]), max_samples=60)
    expected = module.encode_rows(cfg, tokenizer, rows).kept()
    preparation = prepare(module, cfg, tokenizer, rows)
    assert preparation.processes == 2 and not preparation.cached
    examples = preparation.examples.take(range(len(preparation.examples)))
    assert examples == expected
    assert {key: type(value) for key, value in examples[0].items()} == {
        key: type(value) for key, value in expected[0].items()}
    assert preparation.examples[3] == expected[3] and preparation.examples[1:9:3] == expected[1:9:3]
    if module is prompts:  # the rollout loop draws its prompts from the prepared files in the same order
        drawn = PromptStream(preparation.examples, 3, 2)
        walked = PromptStream(prepared.ExampleRows(datasets.Dataset.from_list(expected)), 3, 2)
        assert drawn.take(50) + drawn.take(100) == walked.take(50) + walked.take(100)


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_same_rows_read_the_cache_and_a_changed_row_encodes_again(assets, tokenizer, small_chunks, tmp_path):
    rows = [json.loads(line) for line in assets["pref_train"].read_text().splitlines()][:40]
    path = tmp_path / "pairs.jsonl"
    write_jsonl(path, rows)
    cfg = config("reward_model", path, "--max_len", "128")
    first = prepare(reward_model, cfg, tokenizer, data.load_rows(str(path)))
    again = prepare(reward_model, cfg, tokenizer, data.load_rows(str(path)))
    assert not first.cached and again.cached
    assert again.examples.take(range(40)) == first.examples.take(range(40))
    assert "from the cache of prepared examples" in again.summary("training rows")

    # Files unused for RLHF_EXAMPLE_CACHE_DAYS go when a stage prepares; those in use stay.
    stale = prepared.cache_dir() / "cache-of-a-dataset-gone.arrow"
    stale.write_bytes(b"old")
    os.utime(stale, (time.time() - 8 * 86_400,) * 2)
    assert prepare(reward_model, cfg, tokenizer, data.load_rows(str(path))).cached and not stale.exists()

    rows[33]["chosen"] = rows[33]["chosen"] + " Checked twice."
    write_jsonl(path, rows)
    changed = prepare(reward_model, cfg, tokenizer, data.load_rows(str(path)))
    assert not changed.cached
    assert changed.examples[33] != first.examples[33]
    assert changed.examples.take(range(33)) == first.examples.take(range(33))
    assert tokenizer.decode(changed.examples[33]["chosen_ids"]).endswith("Checked twice.<|eos|>")
    # A field the encoding reads is part of the key; one it does not read is not.
    assert not prepare(reward_model, config("reward_model", path, "--max_len", "100"), tokenizer,
                       data.load_rows(str(path))).cached
    assert prepare(reward_model, config("reward_model", path, "--max_len", "128", "--learning_rate", "0.5"),
                   tokenizer, data.load_rows(str(path))).cached


def test_a_progress_bar_only_for_rows_that_take_a_while(assets, tokenizer, small_chunks, monkeypatch, capfd):
    """A few thousand rows tokenize in seconds: their summary line is enough; more show datasets' bar."""
    from datasets.utils import are_progress_bars_disabled

    monkeypatch.setattr(prepared, "BAR_FROM_ROWS", 30)
    cfg = config("reward_model", assets["pref_train"])
    prepare(reward_model, cfg, tokenizer, data.load_rows(str(assets["pref_train"]), max_samples=29))
    assert "tokenizing examples" not in capfd.readouterr().err
    assert not are_progress_bars_disabled()  # as they were, for the stage's other work
    prepare(reward_model, cfg, tokenizer, data.load_rows(str(assets["pref_train"]), max_samples=30))
    assert "tokenizing examples" in capfd.readouterr().err


def test_rows_dropped_past_the_first_chunk_are_named_by_their_row(assets, tokenizer, small_chunks, tmp_path, caplog):
    rows = [json.loads(line) for line in assets["sft_train"].read_text().splitlines()][:30]
    for row in (12, 25):
        rows[row]["prompt"] = " ".join(["Add 1 and 2."] * 40)  # fills --max_len 64 before the response
    path = tmp_path / "sft.jsonl"
    write_jsonl(path, rows)
    cfg = config("sft", path, "--max_len", "64")
    with caplog.at_level(logging.WARNING, logger="stages.data"):
        preparation = prepare(sft, cfg, tokenizer, data.load_rows(str(path)))
    assert len(preparation.examples) == 28
    assert "dropped 2 of 30 SFT examples (no response token fits in max_len=64" in caplog.text
    assert "rows [12, 25]" in caplog.text
    caplog.clear()  # the node's other ranks open the same examples without saying so again
    with caplog.at_level(logging.WARNING, logger="stages.data"):
        again = prepare(sft, cfg, tokenizer, data.load_rows(str(path)), report=False)
    assert again.cached and len(again.examples) == 28 and "dropped" not in caplog.text
    write_jsonl(path, [rows[12]] * 25)
    with pytest.raises(DataValidationError, match="all 25 SFT examples were dropped"):
        prepare(sft, cfg, tokenizer, data.load_rows(str(path)))


class ReadFields:
    """A config that records which of its fields are read."""

    def __init__(self, cfg):
        self._cfg, self.read = cfg, set()

    def __getattr__(self, name):
        if name in type(self._cfg).model_fields:
            self.read.add(name)
        value = getattr(self._cfg, name)
        return value.__func__.__get__(self) if hasattr(value, "__func__") else value  # methods read through us


@pytest.mark.parametrize(("stage", "module", "dataset", "flags"), FORMATS + [
    ("reward_model", reward_model, "pref_train", ("--margin_loss",))],
    ids=[f"{stage}-{dataset}" for stage, _, dataset, _ in FORMATS] + ["reward_model-margin"])
def test_every_config_field_an_encoder_reads_keys_the_cache(stage, module, dataset, flags, assets, tokenizer,
                                                            tmp_path):
    """A field the encoder reads but its EXAMPLE_FIELDS leaves out would serve examples built with another value."""
    source = assets[dataset]
    if "--margin_loss" in flags:
        source = tmp_path / "margins.jsonl"
        write_jsonl(source, [{**json.loads(line), "margin": 1.0} for line in
                             assets["pref_train"].read_text().splitlines()[:4]])
    recorder = ReadFields(config(stage, source, *flags))
    module.encode_rows(recorder, tokenizer, data.load_rows(str(source), max_samples=4))
    assert recorder.read and recorder.read <= set(module.EXAMPLE_FIELDS)


def _prepare_on_two_ranks(rank: int, store_path: str, leader_fails: bool, results) -> None:
    """Rank 0 takes longer to prepare than the ranks' group waits (2 s): the other rank must wait it out."""
    from datetime import timedelta

    import torch.distributed as dist

    from stages.trainer import StepTrainer

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=2))

    def slow_prepare(encode, cfg, fields, tokenizer, rows, what, report):
        assert report == (rank == 0)  # the node's first rank names the dropped rows, the other opens its files
        if rank == 0:
            time.sleep(4)
            if leader_fails:
                raise DataValidationError("all 3 SFT examples were dropped")
        return prepared.Preparation(prepared.ExampleRows(rows), len(rows), 4.0, rank == 1, 1, 0.1)

    prepared.prepare = slow_prepare
    trainer = StepTrainer.__new__(StepTrainer)
    trainer.rank, trainer.world_size, trainer.stage, trainer.cfg, trainer.tokenizer = rank, 2, "sft", None, None
    trainer.encode_rows = None
    try:
        results[rank] = len(trainer.prepare_examples(datasets.Dataset.from_dict({"a": [1, 2, 3]}), "training rows"))
    except Exception as error:
        results[rank] = f"{type(error).__name__}: {error}"
    dist.destroy_process_group()


@pytest.mark.parametrize("leader_fails", [False, True])
def test_the_other_ranks_wait_for_the_first_rank_however_long_it_prepares(tmp_path, leader_fails):
    """700k pairs take longer to tokenize than a rank's group waits in a collective (10 minutes): a rank timed out
    waiting for its node's first rank. They now wait in a group of their own; a failure there reaches them at once."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_prepare_on_two_ranks, args=(str(tmp_path / "store"), leader_fails, results), nprocs=2)
    if leader_fails:
        assert results[0] == "DataValidationError: all 3 SFT examples were dropped"
        assert results[1] == ("RuntimeError: rank 0 could not prepare the training rows: DataValidationError: all 3 SFT"
                              " examples were dropped")
    else:
        assert dict(results) == {0: 3, 1: 3}



@pytest.mark.parametrize(("variable", "value", "why"), [("RLHF_CPU_CORES", "2.5", "valid integer"),
                                                         ("RLHF_CPU_CORES", "0", "greater than or equal to 1"),
                                                         ("RLHF_EXAMPLE_CACHE_DAYS", "a week", "valid number")])
def test_a_bad_environment_value_stops_the_stage_naming_the_variable(variable, value, why, monkeypatch):
    monkeypatch.setenv(variable, value)
    with pytest.raises(StageInputError, match=rf"{variable}='{value}': .*{why}"):
        stage_environment()
    monkeypatch.delenv(variable)
    monkeypatch.setenv("RLHF_CPU_CORES", "")  # empty: unset
    assert prepared.processes_for(prepared.PARALLEL_FROM_ROWS * 64) == min(len(os.sched_getaffinity(0)),
                                                                           prepared.MAX_PROCESSES)
    monkeypatch.setenv("RLHF_CPU_CORES", "1")
    assert prepared.processes_for(prepared.PARALLEL_FROM_ROWS * 64) == 1
