"""Evaluation suites: benchmark files and formats, the rows each format reads, the gate's rules on benchmarks, and
what the plan and the rehearsal make of a preset's suite (the stage itself: tests/test_stages.py, tests/test_rl.py)."""

from __future__ import annotations

import json
import re

import datasets
import pytest

from pipeline.config import load_pipeline_config
from pipeline.gate import check_gate
from pipeline.plan import check_gate_sample
from pipeline.report import metrics_by_model, metrics_table, model_metric
from stages.cli import parse_stage_args
from stages.errors import DataValidationError
from stages.evaluate.config import EvaluateConfig
from stages.evaluate.suite import Benchmark, benchmark_rows
from stages.config import ConfigError

EVALUATE = ["--pretrain", "p", "--prompt_data", "d", "--remote_rm_url", "r.py"]


def write_suite(path, benchmarks) -> str:
    path.write_text(json.dumps({"benchmarks": benchmarks}))
    return str(path)


# ---------------------------------------------------------------------------------------------- suite files

def test_a_suite_file_is_read_into_the_config_and_its_errors_name_file_and_benchmark(tmp_path, capsys):
    good = write_suite(tmp_path / "suite.yaml", [{"name": "gsm8k", "dataset": "openai/gsm8k", "subset": "main",
                                                 "format": "gsm8k"}])
    cfg = parse_stage_args(EvaluateConfig, [*EVALUATE, "--eval_suite", good])
    assert cfg.eval_suite == [Benchmark(name="gsm8k", dataset="openai/gsm8k", subset="main", format="gsm8k")]
    assert cfg.eval_suite[0].split == "test" and cfg.eval_suite[0].n_samples == 4
    assert parse_stage_args(EvaluateConfig, [*EVALUATE, "--eval_suite", "none"]).eval_suite is None

    for benchmarks, expected in [
        ([{"name": "a", "dataset": "d", "format": "mmlu"}], "benchmark 1 (a): invalid value for format"),
        ([{"name": "a", "dataset": "d", "format": "math"}, {"dataset": "d", "format": "math"}],
         "benchmark 2: invalid value for name: Field required"),
        ([{"name": "a b", "dataset": "d", "format": "math"}], "benchmark 1 (a b): invalid value for name"),
        ([{"name": "a", "format": "math", "n_samples": -1}], "invalid value for n_samples"),
        ([{"name": "a", "format": "math"}, {"name": "a", "format": "gsm8k"}], "benchmark name 'a' is used more than"),
        ([], "an eval suite is a non-empty list of benchmarks"),
    ]:
        bad = write_suite(tmp_path / "bad.yaml", benchmarks)
        with pytest.raises(SystemExit):
            parse_stage_args(EvaluateConfig, [*EVALUATE, "--eval_suite", bad])
        err = capsys.readouterr().err
        assert "--eval_suite" in err and expected in err, (benchmarks, err)
    with pytest.raises(SystemExit):
        parse_stage_args(EvaluateConfig, [*EVALUATE, "--eval_suite", str(tmp_path / "absent.yaml")])
    assert f"cannot read the eval suite {tmp_path / 'absent.yaml'}" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- formats

def rows_of(benchmark: dict, rows: list[dict], **cfg):
    stage = EvaluateConfig(**{"input_key": "prompt", "label_key": "label", "apply_chat_template": True, **cfg})
    return benchmark_rows(Benchmark(name="b", dataset="data.jsonl", **benchmark), datasets.Dataset.from_list(rows),
                          stage)


def test_each_format_reads_its_columns_and_labels():
    gsm8k = [{"question": "Q1", "answer": "2 + 3 = 5\n#### 5"}, {"question": "Q2", "answer": "so\n#### 1,200"}]
    assert rows_of({"format": "gsm8k"}, gsm8k) == (["Q1", "Q2"], ["5", "1200"])
    # MATH: the final answer boxed in the solution; MATH-500 has an answer column, which wins.
    math_rows = [{"problem": "P", "solution": "thus $\\boxed{\\frac{1}{2}}$."}]
    assert rows_of({"format": "math"}, math_rows) == (["P"], ["\\frac{1}{2}"])
    assert rows_of({"format": "math"}, [{**math_rows[0], "answer": "0.5"}]) == (["P"], ["0.5"])
    # prompts: the stage's own columns; named columns override the format's.
    assert rows_of({"format": "prompts"}, [{"prompt": "P", "label": 7}]) == (["P"], ["7"])
    assert rows_of({"format": "gsm8k", "input_key": "q"}, [{"q": "Q", "answer": "#### 3"}]) == (["Q"], ["3"])
    # Preference data: each distinct prompt once; a whole conversation is prompted up to its answer.
    pairs = [{"prompt": "A", "chosen": "x", "rejected": "y"}, {"prompt": "A", "chosen": "x", "rejected": "z"},
             {"prompt": "B", "chosen": "x", "rejected": "y"}]
    assert rows_of({"format": "preference_prompts"}, pairs) == (["A", "B"], ["", ""])
    user, answer = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    chats = [{"chosen": [user, answer], "rejected": [user, {"role": "assistant", "content": "go"}]}]
    assert rows_of({"format": "preference_prompts", "input_key": "chosen"}, chats) == ([[user]], [""])


def test_rows_without_a_final_answer_are_refused_by_file_and_row():
    rows = [{"question": "Q", "answer": "#### 1"}, {"question": "Q", "answer": "no marker"},
            {"question": "Q", "answer": "#### 2"}, {"question": "Q", "answer": "####"}]
    with pytest.raises(DataValidationError, match=r"data.jsonl \(benchmark b, format gsm8k\): column 'answer' has no "
                                                  r"a final answer after #### at rows \[1, 3\]"):
        rows_of({"format": "gsm8k"}, rows)
    with pytest.raises(DataValidationError, match=r"column 'solution' has no a \\boxed\{\} final answer at rows \[0\]"):
        rows_of({"format": "math"}, [{"problem": "P", "solution": "it is 3"}])
    with pytest.raises(DataValidationError, match="column 'question'"):  # the stage's own checks, by column and row
        rows_of({"format": "gsm8k"}, [{"question": "  ", "answer": "#### 1"}])


# ---------------------------------------------------------------------------------------------- the gate's rules

SUITE = [{"name": "gsm8k", "dataset": "openai/gsm8k", "format": "gsm8k"},
         {"name": "chat", "dataset": "prefs.jsonl", "format": "preference_prompts"}]


def report(**benchmarks) -> dict:
    """A report with the unprefixed comparisons passing, and per benchmark (prompts, gain, low, high)."""
    metrics = {"accuracy": 0.6, "reference_accuracy": 0.5, "kl_mean": 0.1, "prompts": 500,
               "production_accuracy": 0.55}
    for other, gain in (("reference", 0.1), ("production", 0.05)):
        key = f"accuracy_gain_vs_{other}"
        metrics |= {key: gain, f"{key}_low": gain - 0.04, f"{key}_high": gain + 0.04}
    for name, (prompts, comparison, gain, low, high) in benchmarks.items():
        metrics[f"{name}/prompts"] = prompts
        for other in ("reference", "production"):
            key = f"{name}/{comparison}_vs_{other}"
            metrics |= {key: gain, f"{key}_low": low, f"{key}_high": high}
    return metrics


def test_gate_rules_decide_on_a_benchmark_interval_and_refuse_too_few_prompts():
    config = load_pipeline_config("tiny", {"evaluate": {"eval_suite": SUITE}, "gate": {
        "min_prompts": 100, "decide_on_intervals": True,
        "rules": [{"benchmark": "gsm8k", "metric": "accuracy", "max_regression": 0.02},
                  {"benchmark": "chat", "metric": "win_rate", "min_gain": 0.05}]}})
    gate = config.gate
    clear = report(gsm8k=(1319, "accuracy_gain", 0.04, 0.01, 0.07), chat=(500, "win_rate", 0.62, 0.57, 0.67))
    passed, reasons = check_gate(clear, gate, production_version=3)
    assert passed, reasons
    assert ("ok   chat: win_rate gain over the reference +0.1200, 95% interval [+0.0700, +0.1700] on 500 prompts "
            "(needs >= +0.0500)") in reasons
    # A gain within noise on GSM8K: its interval reaches below zero; the point estimate alone would pass.
    noisy = report(gsm8k=(1319, "accuracy_gain", 0.01, -0.03, 0.05), chat=(500, "win_rate", 0.62, 0.57, 0.67))
    passed, reasons = check_gate(noisy, gate, production_version=3)
    assert not passed and reasons[0] == ("FAIL gsm8k: accuracy gain over the reference +0.0100, 95% interval "
                                         "[-0.0300, +0.0500] on 1319 prompts (needs >= +0.0000)")
    assert reasons[1] == ("FAIL gsm8k: accuracy vs production v3: gain +0.0100, 95% interval [-0.0300, +0.0500] "
                          "on 1319 prompts (regression tolerance 0.02)")
    assert check_gate(noisy, gate.model_copy(update={"decide_on_intervals": False}), production_version=3)[0]
    # Too few prompts: no decision on that benchmark, whatever its numbers.
    few = report(gsm8k=(40, "accuracy_gain", 0.5, 0.4, 0.6), chat=(500, "win_rate", 0.62, 0.57, 0.67))
    passed, reasons = check_gate(few, gate, production_version=None)
    assert not passed and reasons[0] == "FAIL gsm8k: not deciding on 40 prompts (needs >= 100)"
    # A rule whose metric the report lacks fails, naming the key.
    passed, reasons = check_gate(report(chat=(500, "win_rate", 0.62, 0.57, 0.67)) | {"gsm8k/prompts": 500}, gate,
                                 production_version=None)
    assert not passed and "gsm8k: report has no gsm8k/accuracy_gain_vs_reference" in reasons[0]


def test_gate_rules_must_name_a_benchmark_of_the_suite_that_has_the_metric():
    for rule, expected in [({"benchmark": "mmlu", "metric": "accuracy"}, "mmlu is not a benchmark of evaluate"),
                           ({"benchmark": "chat", "metric": "accuracy"}, "chat (preference_prompts) has no accuracy")]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_pipeline_config("tiny", {"evaluate": {"eval_suite": SUITE}, "gate": {"rules": [rule]}})
    # Shapes without a reward model cannot judge preference prompts nor decide on win rates: said at load time.
    with pytest.raises(ConfigError, match=re.escape("evaluate.eval_suite: benchmark chat (preference_prompts), gate "
                                                    "rule on chat's win_rate needs a reward model, and shape 'sft-dpo' "
                                                    "has none")):
        load_pipeline_config("tiny", {"shape": "sft-dpo", "evaluate": {"eval_suite": SUITE},
                                      "gate": {"rules": [{"benchmark": "chat", "metric": "win_rate"}]}})
    assert load_pipeline_config("tiny", {"shape": "sft-rm-rl", "evaluate": {"eval_suite": SUITE}})
    with pytest.raises(ConfigError, match="evaluate.eval_suite gsm8k.dataset unset"):
        load_pipeline_config("llama3-8b", {"evaluate": {"eval_suite": [{"name": "gsm8k", "format": "gsm8k"}]},
                                           "gate": {"rules": []}})


def test_the_plan_lists_the_suite_and_the_prompts_each_rule_sees(tmp_path):
    local = tmp_path / "gsm8k.jsonl"
    local.write_text("".join(json.dumps({"question": f"Q{i}", "answer": f"#### {i}"}) + "\n" for i in range(30)))
    config = load_pipeline_config("llama3-8b", {"evaluate": {"eval_suite": [
        {"name": "gsm8k", "dataset": str(local), "format": "gsm8k"},
        {"name": "math500", "dataset": "HuggingFaceH4/MATH-500", "format": "math", "max_samples": 400}]}, "gate": {
        "rules": [{"benchmark": "gsm8k", "metric": "accuracy"}, {"benchmark": "math500", "metric": "accuracy"}]}})
    notes, problems = [], []
    check_gate_sample(config, notes, problems)
    assert f"eval suite: gsm8k (gsm8k, {local}@test, 30 prompts, 4 samples per prompt); gate rules on its accuracy" \
        in notes
    assert any(note.startswith("eval suite: math500 (math, HuggingFaceH4/MATH-500@test, at most 400 prompts")
               for note in notes), notes
    assert problems == ["evaluate.eval_suite math500: max_samples=400 is below gate.min_prompts=500: its gate rules "
                        "could never pass"]


# ---------------------------------------------------------------------------------------------- the report

def test_the_report_has_a_table_per_benchmark_and_the_gate_keys_round_trip():
    metrics = {"accuracy": 0.5, "reference_accuracy": 0.25, "prompts": 200, "gsm8k/accuracy": 0.75,
               "gsm8k/reference_accuracy": 0.5, "gsm8k/maj4": 0.8, "gsm8k/prompts": 64,
               "gsm8k/win_rate_vs_reference": 0.6, "gsm8k/win_rate_vs_reference_low": 0.55,
               "gsm8k/win_rate_vs_reference_high": 0.65}
    by_model = metrics_by_model(metrics)
    assert by_model["gsm8k/accuracy"] == {"policy": 0.75, "reference": 0.5} and "gsm8k/win_rate_vs_reference" \
        not in by_model
    assert {model_metric(m, name) for name, values in by_model.items() for m in values} == {
        k for k in metrics if "_vs_" not in k}
    table = metrics_table(metrics)
    held_out, gsm8k = table.split("**gsm8k** (64 prompts)")
    assert "| accuracy | 0.5000 | 0.2500 |" in held_out and "maj4" not in held_out
    assert "| accuracy | 0.7500 | 0.5000 |" in gsm8k and "| maj4 | 0.8000 | – |" in gsm8k
    assert "| win_rate_vs_reference | 0.6000 | [0.5500, 0.6500] |" in gsm8k


def test_a_reward_file_is_keyed_with_the_project_code_it_imports(tmp_path):
    """The math reward compares answers with stages/answers.py: a change there changes the stage key of every stage
    rewarded by the file, as a change to the file itself does."""
    from pipeline.code import imported_code_version
    from pipeline.identity import source_fingerprint

    root = tmp_path / "project"
    (root / "stages").mkdir(parents=True)
    (root / "stages" / "__init__.py").write_text("")
    (root / "stages" / "answers.py").write_text("ANSWER = 1\n")
    reward = tmp_path / "reward.py"
    reward.write_text("from stages.answers import ANSWER\n\ndef reward_func(q, p, l):\n    return [ANSWER] * len(q)\n")
    before = imported_code_version(reward, root)
    (root / "stages" / "answers.py").write_text("ANSWER = 2\n")
    assert before is not None and imported_code_version(reward, root) != before
    standalone = tmp_path / "standalone.py"
    standalone.write_text("import re\n\ndef reward_func(q, p, l):\n    return [0.0] * len(q)\n")
    assert imported_code_version(standalone, root) is None
    assert "+code:" not in source_fingerprint(str(standalone))
    assert "+code:" in source_fingerprint("configs/reward_funcs/math_answer.py")


# ---------------------------------------------------------------------------------------------- lm-eval tasks

def test_lm_eval_tasks_are_listed_either_way_and_an_unknown_one_is_refused_by_name(tmp_path):
    from stages.evaluate import harness
    from stages.errors import StageInputError

    (tmp_path / "tiny_local.yaml").write_text(json.dumps({
        "task": "tiny_local", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": "unused.jsonl"}},
        "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{q}}", "doc_to_target": "{{a}}"}))
    cfg = parse_stage_args(EvaluateConfig, [*EVALUATE, "--lm_eval", "tiny_local,gsm8k", "ifeval",
                                            "--lm_eval_include_path", str(tmp_path)])
    assert cfg.lm_eval == ["tiny_local", "gsm8k", "ifeval"]
    # Local tasks alone: lm-eval's own ~15,000 are not indexed; a name found in neither is refused by name.
    assert harness.task_manager(cfg.model_copy(update={"lm_eval": ["tiny_local"]})).all_tasks == ["tiny_local"]
    with pytest.raises(StageInputError, match="--lm_eval: no lm-eval task or group named tiny_locl$"):
        harness.task_manager(cfg.model_copy(update={"lm_eval": ["gsm8k", "tiny_local", "tiny_locl"]}))
    # A metric lm-eval does not ship would be loaded from the hub and its code run: refused; a !function of the
    # folder (code that comes with the task files, allowed as they are) is not.
    (tmp_path / "tiny_local.yaml").write_text(
        "task: tiny_local\ndataset_path: json\nmetric_list:\n  - metric: exact_match\n  - metric: !function "
        "utils.score\n  - metric: someones/metric\n  - metric: bleu\n    hf_evaluate: true\n")
    with pytest.raises(StageInputError, match=r"metrics neither lm-eval's own nor a !function of the folder "
                                              r"\(tiny_local: 'someones/metric'; tiny_local: 'bleu'\)"):
        harness.task_manager(cfg.model_copy(update={"lm_eval": ["tiny_local"]}))
    # lm-eval's `metric,filter` as metric names, the other models' prefix before the metric.
    assert harness.metric_key("gsm8k", "exact_match,strict-match", "") == "lm_eval/gsm8k/exact_match_strict-match"
    assert harness.metric_key("tiny_local", "acc,none", "reference_") == "lm_eval/tiny_local/reference_acc"


# ---------------------------------------------------------------------------------------------- engines between models

def test_an_engine_takes_another_models_weights_only_when_their_configs_agree_on_all_it_reads(tmp_path):
    """Policy, reference and production go through the same engines by weight swaps (stages/evaluate/run.py): a
    swap is right only when the engine built for one model reads nothing different in the other's config."""
    from stages.evaluate.run import same_architecture

    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": 10000.0,
            "eos_token_id": 1, "vocab_size": 60}

    def saved(name: str, **changes) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**base, **changes}))
        return str(folder)

    policy = saved("policy", dtype="bfloat16", transformers_version="5.0.0", _name_or_path="/somewhere/sft")
    assert same_architecture(policy, saved("reference", dtype="float32"))
    for name, change in {"shape": {"hidden_size": 128}, "positions": {"rope_theta": 500000.0},
                         "stop token": {"eos_token_id": 2}, "family": {"model_type": "qwen2"}}.items():
        assert not same_architecture(policy, saved(name.replace(" ", "-"), **change)), name
