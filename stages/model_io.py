"""Resolve, load and save Hugging Face models and tokenizers (hub names, local dirs, file://, s3://).

A model that is a committed version of the artifact store (its MANIFEST.json beside it) is loaded only through the
store's checked path: `check_model_inputs` verifies, in the stage's driver before any rank starts, the sha256 of
every file against the manifest, where the manifest was read, and that the folder holds nothing it does not list;
a file that differs stops the stage with exit 2 naming it. An s3:// version is downloaded into the model cache
through the same check (transient S3 errors retried), once per node: ranks find the checked copy.

transformers is imported by the functions that load models: resolving a path costs a stage no such import.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
import torch

from infra.artifacts import (
    ArtifactError,
    Manifest,
    StoreSettings,
    StoreUnreachable,
    is_version_folder,
    open_version,
    retrying,
    storage_options_from_env,
)
from stages.environment import stage_environment
from stages.errors import SourceUnavailable, StageInputError
from stages.fields import ModelPath, fields_with
from stages.fingerprint import hub_model_name, split_revision
from stages.lean_imports import lean_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def model_cache_dir() -> Path:
    """Where s3:// models are downloaded: $RLHF_CACHE_DIR, else ~/.cache/rlhf-models."""
    return stage_environment().cache_dir


def resolve_model_path(name_or_uri: str | os.PathLike) -> str:
    """A local directory or hub name for `from_pretrained`.

    Hub names and local paths come back unchanged, `file://` URIs as their path, and `s3://` prefixes are
    downloaded once into the model cache, keyed by the URI and every object's ETag and size, so a changed
    model under the same URI is fetched again. A hub name pinned to a revision (`org/name#<sha>`, as the plan pins
    them) is that revision's snapshot in the hub cache, downloaded if it is not there.
    """
    name_or_uri = os.fspath(name_or_uri)
    if name_or_uri.startswith("file://"):
        return name_or_uri.removeprefix("file://")
    if name_or_uri.startswith("s3://"):
        if is_version_folder(name_or_uri):
            return str(_checked_s3_version(*open_version(name_or_uri, log=logger.warning), verify_cached=False))
        return str(_download_s3_dir(name_or_uri))
    name, revision = split_revision(name_or_uri)
    if revision is not None and hub_model_name(name_or_uri) is not None:
        return _hub_snapshot(name, revision)
    return name_or_uri


def _hub_snapshot(name: str, revision: str) -> str:
    """The local folder of hub model `name` at `revision` (huggingface_hub's cache; offline, what it holds).
    SourceUnavailable (exit 1, retried) while the hub fails; StageInputError (exit 2) when it answers that there
    is no such model or revision."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return retrying(f"download of hub model {name}#{revision}",
                        lambda: snapshot_download(name, revision=revision), StoreSettings().artifact_retry_s,
                        logger.warning)
    except (StoreUnreachable, LocalEntryNotFoundError) as error:  # down, or offline without it in the cache
        raise SourceUnavailable(f"hub model {name}#{revision}: {error}") from error
    except OSError as error:  # the hub answered: no such repository or revision, no access
        raise StageInputError(f"hub model {name}#{revision}: {type(error).__name__}: {error}") from error


def check_model_inputs(stage: str, cfg) -> None:
    """Verify every committed version the config's model fields name (stages/fields.py ModelPath), before any
    rank loads one: StageInputError (exit 2) naming the field and the file that differs; SourceUnavailable (exit 1)
    when the store stays unreachable."""
    for field in fields_with(type(cfg), ModelPath):
        location = getattr(cfg, field)
        if not location:
            continue
        try:
            if not is_version_folder(location):
                continue
            store, manifest = open_version(location, log=logger.warning)
            if location.startswith("s3://"):
                _checked_s3_version(store, manifest, verify_cached=True)
            else:
                store.verify(manifest)
        except StoreUnreachable as error:
            raise SourceUnavailable(f"--{field} {location}: {error}") from error
        except (ArtifactError, OSError) as error:  # a file that differs, a manifest out of place, access denied
            raise StageInputError(f"--{field} {location}: refused: {error}") from error
        print(f"[{stage}] --{field}: {manifest.pipeline}/{manifest.stage} v{manifest.version:04d} checked "
              f"({len(manifest.files)} files, sha256)", flush=True)


def _checked_s3_version(store, manifest: Manifest, verify_cached: bool) -> Path:
    """The model cache's copy of a committed s3:// version, downloaded and checked against its manifest if it is
    not there yet (the cache folder is named by the version's content digest). With `verify_cached`, a copy that
    is already there is checked again, and fetched anew if it differs."""
    readable_name = re.sub(r"[^A-Za-z0-9._-]", "_", f"{manifest.pipeline}-{manifest.stage}-v{manifest.version:04d}")
    cache_root = model_cache_dir()
    target = cache_root / f"{readable_name}-{manifest.digest[:16]}"
    if target.is_dir():
        if not verify_cached:
            return target
        try:
            store.verify_copy(manifest, target)
            return target
        except ArtifactError as error:
            logger.warning("model cache copy differs from its manifest, fetching it again: %s", error)
            shutil.rmtree(target, ignore_errors=True)
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{readable_name}.", dir=cache_root))
    try:
        logger.info("downloading %d files from %s to %s", len(manifest.files), manifest.uri, target)
        store.download(manifest, staging)  # retried, then checked file by file
        _rename_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _rename_into_place(staging: Path, target: Path) -> None:
    """Concurrent downloaders keep whichever rename wins; a crash never leaves a partial model under `target`."""
    try:
        staging.rename(target)
    except OSError:
        if not target.is_dir():
            raise


def _download_s3_dir(uri: str) -> Path:
    """A plain s3:// model folder (not a committed version: nothing to check it against), transient S3 errors
    retried."""
    fs = fsspec.filesystem("s3", **storage_options_from_env(uri))
    fs.invalidate_cache()
    prefix = uri.removeprefix("s3://").rstrip("/")

    def retried(what: str, operation):
        try:
            return retrying(what, operation, StoreSettings().artifact_retry_s, logger.warning)
        except StoreUnreachable as error:
            raise SourceUnavailable(str(error)) from error

    objects = retried(f"listing of {uri}", lambda: fs.find(prefix, detail=True))
    if not objects:
        raise FileNotFoundError(f"no model files under {uri}")
    if list(objects) == [prefix]:
        raise NotADirectoryError(f"{uri} is a single object; expected a model directory (config.json, weights)")
    files = {
        remote[len(prefix) + 1 :]: info for remote, info in objects.items() if info.get("type", "file") == "file"
    }

    fingerprint = hashlib.sha256(prefix.encode())
    for relpath in sorted(files):
        info = files[relpath]
        fingerprint.update(f"\0{relpath}\0{info.get('ETag', '')}\0{info['size']}".encode())
    readable_name = re.sub(r"[^A-Za-z0-9._-]", "_", prefix.rsplit("/", 1)[-1])
    cache_root = model_cache_dir()
    target = cache_root / f"{readable_name}-{fingerprint.hexdigest()[:16]}"
    if target.is_dir():
        return target

    # Download into a temporary sibling and rename it into place: a crash never leaves a partial model
    # under the final name, and concurrent downloaders simply keep whichever rename wins.
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{readable_name}.", dir=cache_root))
    try:
        remote_paths = [f"{prefix}/{relpath}" for relpath in files]
        local_paths = [str(staging / relpath) for relpath in files]
        for local in local_paths:
            Path(local).parent.mkdir(parents=True, exist_ok=True)
        logger.info("downloading %d files from %s to %s", len(files), uri, target)
        retried(f"download of {uri}", lambda: fs.get(remote_paths, local_paths))
        _rename_into_place(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# Tokenizer classes that AutoTokenizer would load as they are named (no Fast variant, no remote code): loaded
# directly, they spare a process that only tokenizes transformers' model registry (seconds of imports).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | os.PathLike, padding_side: str = "right") -> PreTrainedTokenizerBase:
    """Tokenizer from a hub name, directory or URI, as AutoTokenizer loads it; pad token falls back to eos."""
    local = resolve_model_path(path)
    config_path = Path(local) / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in config:
        import transformers

        tokenizer = getattr(transformers, config["tokenizer_class"]).from_pretrained(local)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(local)
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def loading_options(cfg, device: str) -> dict:
    """How a stage loads its models (keyword arguments of load_causal_lm and load_value_model): the dtype of --bf16,
    the attention of --flash_attn and, for a training stage, --load_in_4bit (OpenRLHF applies it to every model of
    the stage: the trained one, the reference, the reward model, the critic)."""
    return dict(dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
                attn_implementation=attn_implementation(cfg, device),
                load_in_4bit=getattr(cfg, "load_in_4bit", False))


def attn_implementation(cfg, device: str) -> str | None:
    """Ring attention with --ring_attn_size > 1 (stages/ring_attention.py; sdpa kernels, on GPU too); else
    FlashAttention-2 with --flash_attn on CUDA; transformers' default (sdpa) otherwise. On CPU --flash_attn cannot
    act (the stage says so once, stages/fields.py). Without the flash-attn package the stage stops before loading."""
    if getattr(cfg, "ring_attn_size", 1) > 1:
        from stages import ring_attention

        ring_attention.register()
        return ring_attention.RING_ATTENTION
    if not (cfg.flash_attn and device == "cuda"):
        return None
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        raise StageInputError("--flash_attn (which --packing_samples turns on, as in OpenRLHF) needs the flash-attn "
                              "package on GPU machines: pip install flash-attn --no-build-isolation, or pass "
                              "--no_flash_attn")
    return "flash_attention_2"


def quantization(load_in_4bit: bool):
    """--load_in_4bit: OpenRLHF's QLoRA weights (4-bit NF4, double quantization, bfloat16 compute); None without it."""
    if not load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load_causal_lm(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
    load_in_4bit: bool = False,
) -> PreTrainedModel:
    """AutoModelForCausalLM from a hub name, directory or URI (its linear layers in 4 bits with `load_in_4bit`)."""
    lean_transformers()
    from transformers import AutoModelForCausalLM

    return keep_4bit_layout(AutoModelForCausalLM.from_pretrained(
        resolve_model_path(path), dtype=dtype, attn_implementation=attn_implementation,
        quantization_config=quantization(load_in_4bit),
    ))


def keep_4bit_layout(model: PreTrainedModel) -> PreTrainedModel:
    """Keep 4-bit layers in bitsandbytes' standard layout. On a CPU with AVX512-BF16, bitsandbytes repacks a layer's
    weights for inference at its first no-grad forward (a reference pass, an evaluation); a training backward through
    a repacked layer then gives its input no gradient (the adapters below it learn from a wrong one, silently), and
    its weights no longer dequantize (merged outputs and weight syncs would be garbage)."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return model


def load_value_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None, *,
    value_head_prefix: str = "score", trained_head: bool = False, load_in_4bit: bool = False,
) -> PreTrainedModel:
    """Scalar-head model (reward model or critic): AutoModelForSequenceClassification with num_labels=1.

    The head's weights are read from the checkpoint under the model class's own head name, else under
    `value_head_prefix` (or the config's `value_head_prefix`, as OpenRLHF saves it). With neither, a model that is
    about to be trained starts from a fresh head and says so; `trained_head` (a frozen reward model) refuses it:
    scores from a random head would make the whole RL run chase noise. pad_token_id is set in the config because
    sequence classifiers score the last non-pad token and refuse batches without it.
    """
    lean_transformers()
    from transformers import AutoModelForSequenceClassification

    local = resolve_model_path(path)
    model, loading = AutoModelForSequenceClassification.from_pretrained(
        local, num_labels=1, dtype=dtype, attn_implementation=attn_implementation, output_loading_info=True,
        quantization_config=quantization(load_in_4bit),
    )
    missing = sorted(loading["missing_keys"])
    if missing:
        prefix = getattr(model.config, "value_head_prefix", None) or value_head_prefix
        _load_head_under(model, local, missing, prefix, sorted(loading["unexpected_keys"]), path, trained_head)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(local).pad_token_id
    return keep_4bit_layout(model)


def _load_head_under(model, local: str, missing: list[str], prefix: str, unexpected: list[str], path,
                     trained_head: bool) -> None:
    """Fill the head weights the class did not find (`missing`, e.g. score.weight) from `<prefix>.<same suffix>`."""
    from safetensors import safe_open

    sources = {key: f"{prefix}.{key.split('.', 1)[1]}" for key in missing if "." in key}
    if len(sources) == len(missing) and all(source in unexpected for source in sources.values()):
        wanted = set(sources.values())
        found: dict[str, torch.Tensor] = {}
        for file in sorted(Path(local).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as weights:
                found.update({name: weights.get_tensor(name) for name in wanted & set(weights.keys())})
        params = dict(model.named_parameters())
        heads = [params[key] for key in sources]
        if any(hasattr(param, "ds_id") for param in heads):  # partitioned by ZeRO-3 while loading: gather to write
            from deepspeed.zero import GatheredParameters

            gathered = GatheredParameters(heads, modifier_rank=0)
        else:
            gathered = contextlib.nullcontext()
        with gathered, torch.no_grad():
            for key, source in sources.items():
                params[key].data.copy_(found[source].reshape(params[key].shape))
        print(f"value model {path}: head {', '.join(missing)} read from {', '.join(sources.values())}", flush=True)
        return
    if trained_head:
        raise StageInputError(
            f"reward model {path} has no trained value head: {', '.join(missing)} missing from its weights, and no "
            f"{prefix}.* either (--value_head_prefix {prefix}); weights the model did not use: "
            f"{', '.join(unexpected[:8]) or 'none'}. Name its head with --value_head_prefix, or train one with "
            "stages.reward_model"
        )
    print(f"value model {path}: no trained head in its weights ({', '.join(missing)}): training starts from a fresh "
          "one", flush=True)


def save_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    extra_config: dict | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save model (safetensors) and tokenizer to `out_dir`; `extra_config` entries are merged into config.json.

    `state_dict` overrides the model's own weights, e.g. a gathered ZeRO-3 state dict.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if getattr(model.config, "quantization_config", None) is not None:
        # 4-bit weights (--load_in_4bit) are written as the full ones in `state_dict` (merged, dequantized), through
        # a weightless twin without quantization: saving the quantized model writes its own weights.
        assert state_dict is not None, "a quantized model is saved from its full weights"
        config = copy.deepcopy(model.config)
        del config.quantization_config
        with torch.device("meta"):
            model = type(model)(config).to(next(w.dtype for w in state_dict.values() if w.is_floating_point()))
    model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)
    if extra_config:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config.update(extra_config)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
