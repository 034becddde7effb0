"""Resolve, load and save Hugging Face models and tokenizers (hub names, local dirs, file://, s3://).

transformers is imported by the functions that load models: resolving a path costs a stage no such import.
"""

from __future__ import annotations

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

from infra.artifacts import storage_options_from_env

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def model_cache_dir() -> Path:
    """Where s3:// models are downloaded: $RLHF_CACHE_DIR, else ~/.cache/rlhf-models."""
    return Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-models")


def resolve_model_path(name_or_uri: str | os.PathLike) -> str:
    """A local directory or hub name for `from_pretrained`.

    Hub names and local paths come back unchanged, `file://` URIs as their path, and `s3://` prefixes are
    downloaded once into the model cache, keyed by the URI and every object's ETag and size, so a changed
    model under the same URI is fetched again.
    """
    name_or_uri = os.fspath(name_or_uri)
    if name_or_uri.startswith("file://"):
        return name_or_uri.removeprefix("file://")
    if name_or_uri.startswith("s3://"):
        return str(_download_s3_dir(name_or_uri))
    return name_or_uri


def _download_s3_dir(uri: str) -> Path:
    fs = fsspec.filesystem("s3", **storage_options_from_env(uri))
    fs.invalidate_cache()
    prefix = uri.removeprefix("s3://").rstrip("/")
    objects = fs.find(prefix, detail=True)
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
        fs.get(remote_paths, local_paths)
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():
                raise
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


def attn_implementation(cfg, device: str) -> str | None:
    """FlashAttention-2 with --flash_attn on CUDA; transformers' default (sdpa) otherwise. On CPU the flag cannot act
    (the stage says so once, stages/fields.py)."""
    return "flash_attention_2" if cfg.flash_attn and device == "cuda" else None


def load_causal_lm(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> PreTrainedModel:
    """AutoModelForCausalLM from a hub name, directory or URI."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        resolve_model_path(path), dtype=dtype, attn_implementation=attn_implementation
    )


def load_value_model(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> PreTrainedModel:
    """Scalar-head model (reward model or critic): AutoModelForSequenceClassification with num_labels=1.

    The head is freshly initialised when `path` holds a plain causal LM. pad_token_id is set in the config
    because sequence classifiers score the last non-pad token and refuse batches without it.
    """
    from transformers import AutoModelForSequenceClassification

    local = resolve_model_path(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        local, num_labels=1, dtype=dtype, attn_implementation=attn_implementation
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(local).pad_token_id
    return model


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
    model.save_pretrained(out, state_dict=state_dict)
    tokenizer.save_pretrained(out)
    if extra_config:
        config_path = out / "config.json"
        config = json.loads(config_path.read_text())
        config.update(extra_config)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
