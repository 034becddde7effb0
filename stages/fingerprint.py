"""Fingerprints of datasets: what a stage read, so that changed data is noticed although its path is the same.

- local files: sha256 of the content; files over LARGE_FILE_BYTES use size + modification time instead (hashing
  many GB at every start costs minutes);
- local directories: the data files under them (.json/.jsonl/.parquet), each as above;
- s3:// objects and prefixes: each object's ETag and size (no download);
- hub datasets: the commit sha of the dataset repository. A source pinned to a revision (`org/name#<sha>`, what
  the plan makes of a hub name) is that revision, without asking the hub; an unpinned one is looked up, the
  look-up retried while the hub fails transiently, and a look-up that keeps failing raises HubUnavailable rather
  than standing in for a revision (a fingerprint that changes with the hub's health would change the stage key).
  The plan pins hub models the same way (`pin_hub_model`): the pinned name is in the stage's config, so its key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

from stages.errors import SourceUnavailable, StageInputError

LARGE_FILE_BYTES = 256 * 2**20
DATA_SUFFIXES = (".json", ".jsonl", ".parquet")
HUB_TIMEOUT_S = 10.0
HUB_RETRY_S = 4.0  # three look-ups, 1 s and 2 s apart: a hub blip passes, a machine without the hub fails fast
# "path@split" or "org/name@validation[:100]" (the same suffix stages.data.load_rows accepts)
_SPLIT_SUFFIX = re.compile(r"^(?P<path>.+)@(?P<split>\w[\w.-]*(\[[^\]]*\])?)$")
# "org/name#<revision>": a hub dataset pinned to a revision of its repository
_REVISION = re.compile(r"^(?P<name>[^#]+)#(?P<revision>[\w.-]+)$")
# "org/name" or "name": a hub repository id (a model field's value that is no path)
_HUB_REPOSITORY = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")
logger = logging.getLogger(__name__)


class HubUnavailable(SourceUnavailable):
    """The hub did not tell a dataset's or a model's revision (no network, an outage): the run cannot pin what it
    would read."""


# Inside hub_outage_remembered: endpoint -> what did not get an answer from it.
_hub_outage: ContextVar[dict[str, str] | None] = ContextVar("hub_outage", default=None)


def _hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


@contextmanager
def hub_outage_remembered() -> Iterator[None]:
    """Within it, a hub (HF_ENDPOINT) that did not answer is not asked again: a plan of eight hub names waits out
    the look-up retries once, not eight times. Each use starts afresh, so a retried plan asks the hub again."""
    token = _hub_outage.set({})
    try:
        yield
    finally:
        _hub_outage.reset(token)


def hub_down() -> str | None:
    """What did not get an answer from the hub, within hub_outage_remembered; None elsewhere."""
    seen = _hub_outage.get()
    return seen.get(_hub_endpoint()) if seen is not None else None


def _note_hub_down(what: str) -> None:
    seen = _hub_outage.get()
    if seen is not None:
        seen[_hub_endpoint()] = what


def hub_file(name: str, filename: str, revision: str | None = None) -> Path:
    """A file of hub model `name`: from the local hub cache when it is there, else downloaded. HubUnavailable when
    the hub does not answer (or did not a moment ago) and the cache does not hold it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(name, filename, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if why := hub_down():
        raise HubUnavailable(f"hub model {name}: {filename} not fetched: the hub did not answer {why} a moment ago")
    try:
        return Path(hf_hub_download(name, filename, revision=revision))
    except LocalEntryNotFoundError as error:  # the hub could not be reached, and nothing is cached
        _note_hub_down(f"the download of {filename} of hub model {name}")
        raise HubUnavailable(f"hub model {name}: {filename}: the hub cannot be reached ({error})") from error


def mixture_parts(source: str) -> list[str]:
    """The datasets a source names: one, or a comma-separated mixture (OpenRLHF's `--dataset a.jsonl,org/b`)."""
    return [part.strip() for part in source.split(",")]


def split_revision(path: str) -> tuple[str, str | None]:
    """`"org/name#sha"` -> ("org/name", "sha"); anything else -> (path, None)."""
    match = _REVISION.match(path)
    return (match["name"], match["revision"]) if match else (path, None)


def hub_dataset_name(source: str) -> str | None:
    """The hub repository `source` names (split suffix and pin left out), or None for files, folders and s3://."""
    match = _SPLIT_SUFFIX.match(source)
    path = (match["path"] if match else source).removeprefix("file://")
    if path.startswith("s3://") or Path(path).expanduser().exists():
        return None
    if path.startswith(("/", "./", "../", "~")) or Path(path).suffix in DATA_SUFFIXES:
        return None
    return split_revision(path)[0]


def unpinned_hub_dataset(source: str) -> bool:
    """Whether `source` names a hub dataset without a revision (in a mixture: any of its parts)."""
    if "," in source:
        return any(unpinned_hub_dataset(part) for part in mixture_parts(source))
    match = _SPLIT_SUFFIX.match(source)
    path = match["path"] if match else source
    return hub_dataset_name(source) is not None and split_revision(path)[1] is None


def pin_hub_revision(source: str) -> str:
    """`source` with a hub dataset pinned to its current revision (`org/name#<sha>[@split]`); other sources and
    pinned ones unchanged (in a mixture: each part). HubUnavailable when the hub does not answer."""
    if "," in source:
        return ",".join(pin_hub_revision(part) for part in mixture_parts(source))
    if not unpinned_hub_dataset(source):
        return source
    match = _SPLIT_SUFFIX.match(source)
    name, split = hub_dataset_name(source), f"@{match['split']}" if match else ""
    return f"{name}#{hub_revision(name)}{split}"


def dataset_fingerprint(source: str) -> str:
    """A short string that changes when the data behind `source` changes (see the module docstring); a mixture's
    is its parts' in order."""
    if "," in source:
        return " + ".join(dataset_fingerprint(part) for part in mixture_parts(source))
    match = _SPLIT_SUFFIX.match(source)
    path = (match["path"] if match else source).removeprefix("file://")
    if path.startswith("s3://"):
        return _s3_fingerprint(path)
    local = Path(path).expanduser()
    if local.is_file():
        return _file_fingerprint(local)
    if local.is_dir():
        return f"dir:{_tree_digest(local, lambda path: path.suffix in DATA_SUFFIXES)}"
    if path.startswith(("/", "./", "../", "~")) or Path(path).suffix in DATA_SUFFIXES:
        return "missing"
    name, revision = split_revision(path)
    return f"hub:{name}@{revision or hub_revision(name)}"


def code_folder_fingerprint(folder: Path) -> str:
    """Every regular file under `folder` (names and contents), for a folder of code a stage runs."""
    return f"code-dir:{_tree_digest(folder, lambda path: '__pycache__' not in path.parts)}"


def _tree_digest(folder: Path, keep) -> str:
    """A digest of the names and contents of the regular files under `folder` that `keep` accepts."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file() and keep(p)):
        digest.update(f"{file.relative_to(folder)}\0{_file_fingerprint(file)}\0".encode())
    return digest.hexdigest()[:32]


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

    from infra.artifacts import StoreSettings, retrying, storage_options_from_env

    fs = fsspec.filesystem("s3", **storage_options_from_env(uri))
    fs.invalidate_cache()
    objects = retrying(f"listing of {uri}", lambda: fs.find(uri.removeprefix("s3://"), detail=True),
                       StoreSettings().artifact_retry_s, logger.warning)
    if not objects:
        return "missing"
    digest = hashlib.sha256()
    for key in sorted(objects):
        info = objects[key]
        digest.update(f"{key}\0{info.get('ETag', '')}\0{info.get('size', '')}\0".encode())
    return f"s3:{digest.hexdigest()[:32]}"


def hub_model_name(value: str) -> str | None:
    """The hub repository a model field names (its pin left out), or None for a local folder, a file:// or s3://
    URI and a path that merely does not exist yet."""
    if "://" in value or Path(value).expanduser().exists() or value.startswith(("/", "./", "../", "~")):
        return None
    name = split_revision(value)[0]
    return name if _HUB_REPOSITORY.match(name) else None


def pin_hub_model(value: str) -> str:
    """A hub model name pinned to the revision the hub names now (`org/name#<sha>`, what the job then downloads);
    anything else, and a name pinned already, unchanged. HubUnavailable when the hub does not answer."""
    name = hub_model_name(value)
    if name is None or split_revision(value)[1] is not None:
        return value
    return f"{name}#{hub_revision(name, kind='model')}"


@cache
def hub_revision(name: str, kind: str = "dataset") -> str:
    """The commit sha of hub repository `name` (a "dataset" or a "model"), looked up again while the hub fails
    transiently (HUB_RETRY_S). HubUnavailable when it cannot be told; StageInputError when the hub answers that
    there is no such repository."""
    from infra.artifacts import StoreUnreachable, retrying

    offline = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if kind == "dataset" else ("HF_HUB_OFFLINE",)
    if any(os.environ.get(variable) == "1" for variable in offline):
        raise HubUnavailable(f"hub {kind} {name}: its revision cannot be looked up offline ({offline[0]})")
    if why := hub_down():
        raise HubUnavailable(f"hub {kind} {name}: not looked up: the hub did not answer {why} a moment ago")
    from huggingface_hub import HfApi

    info = HfApi().dataset_info if kind == "dataset" else HfApi().model_info
    try:
        return retrying(f"revision look-up of hub {kind} {name}", lambda: info(name, timeout=HUB_TIMEOUT_S).sha,
                        HUB_RETRY_S, logger.warning)
    except StoreUnreachable as error:
        _note_hub_down(f"the look-up of hub {kind} {name}")
        raise HubUnavailable(f"hub {kind} {name}: {error}") from error
    except OSError as error:  # the hub answered: no such repository, no access
        raise StageInputError(f"hub {kind} {name}: {type(error).__name__}: {error}") from error
