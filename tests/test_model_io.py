"""Model resolution (local, file://, s3:// with a download cache), loading and HF-format saving."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import replace_stored

from infra.artifacts import storage_options_from_env
from infra.settings import PROJECT_ROOT
from stages import model_io
from stages.tiny import build_tiny_model

TOKENS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "model-cache"
    monkeypatch.setenv("RLHF_CACHE_DIR", str(cache))
    return cache


def test_resolve_model_path_passes_names_and_local_dirs_through(tiny_model_dir):
    assert model_io.resolve_model_path("meta-llama/Meta-Llama-3-8B") == "meta-llama/Meta-Llama-3-8B"
    assert model_io.resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir)
    assert model_io.resolve_model_path(f"file://{tiny_model_dir}") == str(tiny_model_dir)


def test_resolve_model_path_downloads_s3_once_per_content(tiny_model_dir, s3_root, model_cache):
    fs = fsspec.filesystem("s3", **storage_options_from_env(s3_root))
    fs.put(f"{tiny_model_dir}/", f"{s3_root}/model/", recursive=True)

    local = Path(model_io.resolve_model_path(f"{s3_root}/model"))
    assert local.parent == model_cache
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in tiny_model_dir.iterdir())
    assert [p.name for p in model_cache.iterdir()] == [local.name]  # no staging dir left behind
    assert model_io.resolve_model_path(f"{s3_root}/model/") == str(local)  # cached

    config = json.loads((tiny_model_dir / "config.json").read_text())
    fs.pipe(f"{s3_root}/model/config.json", json.dumps({**config, "note": "changed"}).encode())
    changed = Path(model_io.resolve_model_path(f"{s3_root}/model"))
    assert changed != local and json.loads((changed / "config.json").read_text())["note"] == "changed"

    with pytest.raises(FileNotFoundError, match=f"{s3_root}/absent"):
        model_io.resolve_model_path(f"{s3_root}/absent")


def test_load_causal_lm_from_s3_matches_local(tiny_model_dir, s3_root, model_cache):
    fs = fsspec.filesystem("s3", **storage_options_from_env(s3_root))
    fs.put(f"{tiny_model_dir}/", f"{s3_root}/model/", recursive=True)
    remote = model_io.load_causal_lm(f"{s3_root}/model")
    local = model_io.load_causal_lm(str(tiny_model_dir))
    torch.testing.assert_close(remote(TOKENS).logits, local(TOKENS).logits)
    assert model_io.load_tokenizer(f"{s3_root}/model").eos_token == "<|eos|>"


def test_load_tokenizer_sets_padding_side_and_falls_back_to_eos(tiny_model_dir, tmp_path):
    assert model_io.load_tokenizer(str(tiny_model_dir), padding_side="left").padding_side == "left"
    tokenizer = model_io.load_tokenizer(str(tiny_model_dir))
    assert tokenizer.padding_side == "right" and tokenizer.pad_token == "<|pad|>"
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "no_pad")
    assert model_io.load_tokenizer(str(tmp_path / "no_pad")).pad_token == "<|eos|>"


def test_save_hf_round_trips_causal_lm_with_extra_config(tiny_model_dir, tmp_path):
    model = model_io.load_causal_lm(str(tiny_model_dir))
    tokenizer = model_io.load_tokenizer(str(tiny_model_dir))
    out = model_io.save_hf(model, tokenizer, tmp_path / "out", extra_config={"stage": "sft"})
    assert (out / "model.safetensors").exists() and not list(out.glob("*.bin"))
    assert json.loads((out / "config.json").read_text())["stage"] == "sft"
    reloaded = model_io.load_causal_lm(str(out))
    torch.testing.assert_close(reloaded(TOKENS).logits, model(TOKENS).logits)
    assert model_io.load_tokenizer(str(out)).get_vocab() == tokenizer.get_vocab()


def test_value_model_has_scalar_head_and_keeps_reward_stats(tiny_model_dir, tmp_path):
    value_model = model_io.load_value_model(str(tiny_model_dir))
    tokenizer = model_io.load_tokenizer(str(tiny_model_dir))
    assert value_model.config.num_labels == 1 and value_model.config.pad_token_id == tokenizer.pad_token_id
    scores = value_model(TOKENS, attention_mask=(TOKENS != 0).long()).logits
    assert scores.shape == (2, 1)

    out = model_io.save_hf(value_model, tokenizer, tmp_path / "rm", extra_config={"mean": 0.5, "std": 2.0})
    reloaded = model_io.load_value_model(str(out))
    assert (reloaded.config.mean, reloaded.config.std) == (0.5, 2.0)
    torch.testing.assert_close(reloaded(TOKENS, attention_mask=(TOKENS != 0).long()).logits, scores)


def test_value_model_gets_pad_token_id_from_tokenizer(tiny_model_dir, tmp_path):
    unpadded = tmp_path / "unpadded"
    shutil.copytree(tiny_model_dir, unpadded)
    config = json.loads((unpadded / "config.json").read_text())
    (unpadded / "config.json").write_text(json.dumps({**config, "pad_token_id": None}))
    value_model = model_io.load_value_model(str(unpadded))
    assert value_model.config.pad_token_id == model_io.load_tokenizer(str(unpadded)).pad_token_id


# ---------------------------------------------------------------------------------------------- checked loads

def flip_a_byte(fs, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0x01
    replace_stored(fs, path, bytes(data))


@pytest.mark.parametrize("backend", ["file", "s3"])
def test_a_committed_model_is_loaded_only_after_its_checksums_and_a_flipped_byte_stops_the_stage(
        backend, tiny_model_dir, tmp_path, model_cache, request):  # fmt: skip
    from infra.artifacts import open_store
    from stages.errors import StageInputError
    from stages.reward_model.config import RewardModelConfig

    root = str(tmp_path / "artifacts") if backend == "file" else request.getfixturevalue("s3_root")
    store = open_store(root, "pipe")
    sft = store.commit("sft", tiny_model_dir, config={})
    cfg = RewardModelConfig(pretrain=sft.uri if backend == "s3" else sft.uri.removeprefix("file://"))
    model_io.check_model_inputs("reward_model", cfg)
    if backend == "s3":  # checked into the cache once; the ranks load that copy
        (cached,) = model_cache.iterdir()
        assert model_io.resolve_model_path(sft.uri) == str(cached)
        flip_a_byte(fsspec.filesystem("file"), str(cached / "model.safetensors"))
        model_io.check_model_inputs("reward_model", cfg)  # a copy that differs is fetched again
        store.verify_copy(sft, cached)

    flip_a_byte(store.fs, f"{store.fs._strip_protocol(sft.uri)}/model.safetensors")
    shutil.rmtree(model_cache, ignore_errors=True)
    with pytest.raises(StageInputError, match=r"--pretrain .*sft/v0001: refused: .*model\.safetensors.*sha256"):
        model_io.check_model_inputs("reward_model", cfg)
    assert not model_cache.exists() or not any(p.name.startswith("pipe-sft") for p in model_cache.iterdir())


def test_names_and_plain_folders_are_loaded_as_they_are(tiny_model_dir):
    from stages.reward_model.config import RewardModelConfig

    model_io.check_model_inputs("reward_model", RewardModelConfig(pretrain="meta-llama/Meta-Llama-3-8B"))
    model_io.check_model_inputs("reward_model", RewardModelConfig(pretrain=str(tiny_model_dir)))  # no manifest


def reward_model_with_head_named(tiny_model_dir: Path, out: Path, head: str) -> tuple[Path, torch.Tensor]:
    """The tiny model as a reward model whose trained head is saved as `<head>.weight`; returns its dir and head."""
    from safetensors.torch import load_file, save_file

    model = model_io.load_value_model(tiny_model_dir)
    torch.manual_seed(1)
    torch.nn.init.normal_(model.score.weight)
    model.save_pretrained(out)
    shutil.copy(tiny_model_dir / "tokenizer.json", out / "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).exists():
            shutil.copy(tiny_model_dir / name, out / name)
    (weights_file,) = out.glob("*.safetensors")
    weights = load_file(weights_file)
    weights[f"{head}.weight"] = weights.pop("score.weight")
    save_file(weights, weights_file, metadata={"format": "pt"})
    return out, model.score.weight.detach().clone()


def test_a_reward_model_never_scores_with_a_head_it_did_not_train(tiny_model_dir, tmp_path):
    from stages.errors import StageInputError

    with pytest.raises(StageInputError, match=r"reward model .* has no trained value head: score.weight missing"):
        model_io.load_value_model(tiny_model_dir, trained_head=True)  # a plain causal LM
    renamed, head = reward_model_with_head_named(tiny_model_dir, tmp_path / "rm", "value_head")
    with pytest.raises(StageInputError, match=r"score.weight missing .* weights the model did not use: "
                                              r"value_head.weight. Name its head with --value_head_prefix"):
        model_io.load_value_model(renamed, trained_head=True)
    loaded = model_io.load_value_model(renamed, trained_head=True, value_head_prefix="value_head")
    assert torch.equal(loaded.score.weight, head)
    # A critic about to be trained may start from a fresh head.
    assert model_io.load_value_model(tiny_model_dir).score.weight.shape == head.shape


def _export_on_two_ranks(rank: int, out_dir: str, store: str, grown) -> None:
    import threading

    import psutil
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import peft.tuners.lora  # noqa: F401 - what export_hf imports, in memory before the measure
    import safetensors.torch  # noqa: F401
    from stages.engine import export_hf
    from stages.model_io import save_hf  # noqa: F401
    from stages.tiny import build_tokenizer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                                         num_hidden_layers=4, num_attention_heads=8, tie_word_embeddings=False))
    tokenizer = build_tokenizer()
    process, highest, done = psutil.Process(), [0], threading.Event()

    def sample() -> None:  # the resident memory while the export runs, every few milliseconds
        while not done.is_set():
            highest[0] = max(highest[0], process.memory_info().rss)
            done.wait(0.002)

    before = process.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    export_hf(model, tokenizer, out_dir)
    done.set()
    sampler.join()
    grown[rank] = highest[0] - before
    grown[f"bytes{rank}"] = sum(p.numel() * p.element_size() for p in model.parameters())
    dist.destroy_process_group()


def test_only_the_writing_rank_copies_the_model_to_host_memory_at_export(tmp_path):
    """Every rank walks the weights (under ZeRO-3 the gathers are collectives), but only rank 0 writes them: the
    others walk on the meta device. Each rank used to copy the whole model (an 8B model: 16 GiB, times 8 ranks)."""
    import torch.multiprocessing as mp

    grown = mp.Manager().dict()
    mp.spawn(_export_on_two_ranks, args=(str(tmp_path / "model"), str(tmp_path / "store"), grown), nprocs=2)
    size = grown["bytes0"]  # about 180 MB
    assert grown[0] > 0.8 * size, dict(grown)  # the writer's copy shows in its memory...
    assert grown[1] < 0.2 * size, dict(grown)  # ...the other rank's does not
    assert model_io.load_causal_lm(str(tmp_path / "model")).num_parameters() == size // 4


def test_a_rank_loads_its_model_and_schedule_without_importing_scikit_learn_scipy_or_peft(tiny_model_dir):
    """stages/lean_imports.py: what a training rank imports to load a model and build its LR schedule leaves out
    scikit-learn, scipy and peft (installed here, by lm-eval and for LoRA), and transformers reports them installed
    after."""
    code = f"""
import sys
import torch
from stages.model_io import load_causal_lm
model = load_causal_lm({str(tiny_model_dir)!r})
from transformers import get_scheduler
get_scheduler("cosine", torch.optim.AdamW(model.parameters()), num_warmup_steps=1, num_training_steps=4)
import transformers.utils
print(sorted(name for name in ("sklearn", "scipy", "peft", "bitsandbytes") if name in sys.modules),
      transformers.utils.is_sklearn_available(), transformers.utils.is_scipy_available(),
      transformers.utils.is_peft_available())
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-4:] == ["[]", "True", "True", "True"], done.stdout
