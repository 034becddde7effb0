"""Fingerprints of datasets: what a stage read, so that changed data is noticed although its path is the same.

- local files: sha256 of the content; files over LARGE_FILE_BYTES use size + modification time instead (hashing
  many GB at every start costs minutes);
- local directories: the data files under them (.json/.jsonl/.parquet), each as above;
- s3:// objects and prefixes: each object's ETag and size (no download);
- hub datasets: the resolved commit sha of the dataset repository; without hub access (offline, no network) the
  name alone, marked "unresolved".
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

LARGE_FILE_BYTES = 256 * 2**20
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
HUB_TIMEOUT_S = 10.0
# "path@split" or "org/name@validation[:100]" (the same suffix stages.data.load_rows accepts)
_SPLIT_SUFFIX = re.compile(r"^(?P<path>.+)@(?P<split>\w[\w.-]*(\[[^\]]*\])?)$")


def dataset_fingerprint(source: str) -> str:
    """A short string that changes when the data behind `source` changes (see the module docstring)."""
    match = _SPLIT_SUFFIX.match(source)
    path = (match["path"] if match else source).removeprefix("file://")
    if path.startswith("s3://"):
        return _s3_fingerprint(path)
    local = Path(path).expanduser()
    if local.is_file():
        return _file_fingerprint(local)
    if local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.suffix in DATA_SUFFIXES)
        digest = hashlib.sha256()
        for file in files:
            digest.update(f"{file.relative_to(local)}\0{_file_fingerprint(file)}\0".encode())
        return f"dir:{digest.hexdigest()[:32]}"
    if path.startswith(("/", "./", "../", "~")) or Path(path).suffix in DATA_SUFFIXES:
        return "missing"
    return _hub_fingerprint(path)


def _file_fingerprint(path: Path) -> str:
    stat = path.stat()
    if stat.st_size > LARGE_FILE_BYTES:
        return f"stat:{stat.st_size}-{stat.st_mtime_ns}"
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(8 * 2**20), b""):
            digest.update(block)
    return f"sha256:{digest.hexdigest()}"


def _s3_fingerprint(uri: str) -> str:
    import fsspec

    from infra.artifacts import storage_options_from_env

    fs = fsspec.filesystem("s3", **storage_options_from_env(uri))
    fs.invalidate_cache()
    objects = fs.find(uri.removeprefix("s3://"), detail=True)
    if not objects:
        return "missing"
    digest = hashlib.sha256()
    for key in sorted(objects):
        info = objects[key]
        digest.update(f"{key}\0{info.get('ETag', '')}\0{info.get('size', '')}\0".encode())
    return f"s3:{digest.hexdigest()[:32]}"


def _hub_fingerprint(name: str) -> str:
    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return f"hub:{name}@unresolved"
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(name, timeout=HUB_TIMEOUT_S).sha
    except Exception:  # no network, no such repo, no access: the name is all we know
        return f"hub:{name}@unresolved"
    return f"hub:{name}@{sha}"
