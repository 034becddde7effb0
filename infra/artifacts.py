"""Versioned artifact store over fsspec: plain paths / file:// by default, s3:// through s3fs.

Layout under ``<root>/<pipeline>/<stage>/``::

    v0001/...             payload files, then MANIFEST.json written last: a version exists iff its manifest does
    aliases/<name>/000001.json  the moves of an alias, each created exclusively; the newest readable is where it points
    _claims/v0001.json    version claims, created exclusively; never overwritten, never deleted
    _quarantine/v0001.json  versions found damaged (what was wrong): skipped by reuse and listed as QUARANTINED
    _staging/<token>/     uploads in flight; moved into the claimed version directory

A commit uploads into a private staging prefix, claims the next free version number by exclusive create,
moves the staged files into that version directory and writes MANIFEST.json last. Every operation goes
through the same fsspec calls for both backends; only the storage options differ. A commit refuses symlinks and
non-finite metrics (JSON has no NaN: the manifest could not be read back).

Reading is checked: a manifest whose pipeline, stage or version differ from the folder it was read from, whose
files table does not match its digest, or whose file names are absolute, contain `..` or backslashes is refused;
its `uri` is where it was read (a store copied to another bucket never loads from the old one). `verify` re-hashes
every file and refuses files the manifest does not list and symlinks. Listings skip unreadable manifests and say so.
Before a version is reused, `verify_for_reuse` checks it (every hash on a local store, every size on S3); a damaged
one is quarantined, so that the next run builds it again instead of failing on it every night.

An alias moves by compare-and-swap: `set_alias(..., expected=v)` creates the next move record exclusively only
while the alias still points at `v`; a concurrent move makes it fail with AliasMoved, naming where it points now.

Transient failures (endpoint unreachable, connection reset, timeouts) are retried with exponential backoff for
up to `retry_for_s`; each step is safe to repeat, so an outage in the middle of a commit delays it and leaves no
partial version. What a killed writer leaves behind (a `_staging/` entry, a claimed version directory without a
manifest) is invisible to readers and removed once older than `staging_grace_s`, by the next commit of that
stage or by `python -m infra.artifacts gc <root>`; each leftover is looked at again just before it is removed, and
no grace below `min_staging_grace_s` is accepted (a live upload must never be taken for a leftover). A writer
paused for longer than the grace, whose claimed folder another writer's clean-up took meanwhile, finds its files
gone before (or just after) its manifest is written, and commits nothing.

On a local store a commit is flushed to disk in order (the files, the folders they moved into, the manifest and its
folder) before it returns, and the committed files are made read-only; on S3 a PUT is durable once it returns, and
object lock on the bucket is the operator's.

    python -m infra.artifacts list <root> <pipeline>
    python -m infra.artifacts verify <root> <pipeline> [--stage STAGE]
    python -m infra.artifacts gc <root> [--pipeline PIPELINE] [--grace-s SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hashlib
import json
import math
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MANIFEST_NAME = "MANIFEST.json"
LATEST = "latest"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_VERSION_REF = re.compile(r"^v?(\d+)$")
_VERSION_PATH = re.compile(r"/v(\d+)(?:\.json|/" + re.escape(MANIFEST_NAME) + r")?$")
_HASH_BLOCK = 8 * 2**20
_MAX_CLAIM_ATTEMPTS = 1000
STAGING = "_staging"
_MAX_BACKOFF_S = 30.0
ALIASES = "aliases"
ANY = object()  # set_alias without a compare-and-swap
MAX_METRIC_NAME = 200
MAX_METRICS_BYTES = 16 * 2**20  # metrics.json: a few hundred numbers; anything near this was not written as metrics
# An unreadable alias move record younger than this may still be being written (by a mover that creates, then
# writes): it is read again until it is this old, and only then skipped as torn.
MOVE_IN_PROGRESS_S = 10.0
T = TypeVar("T")


class StoreSettings(BaseSettings):
    """How the store retries and cleans up, from RLHF_* variables (the orchestration's Settings extend these)."""

    model_config = SettingsConfigDict(env_prefix="RLHF_", extra="ignore")

    artifact_retry_s: float = Field(
        600.0,
        ge=0,
        description="How long an artifact-store operation keeps retrying transient failures (S3 endpoint "
        "unreachable, timeouts, 5xx) with exponential backoff before the commit fails (RLHF_ARTIFACT_RETRY_S).",
    )
    staging_grace_s: float = Field(
        24 * 3600.0,
        ge=0,
        description="Age after which `_staging/` leftovers of killed writers (and claimed versions that never "
        "got a manifest) are removed by the next commit of their stage and by `python -m infra.artifacts gc`; "
        "longer than any upload (RLHF_STAGING_GRACE_S).",
    )
    min_staging_grace_s: float = Field(
        3600.0,
        ge=0,
        description="The smallest grace period gc and commits accept: a younger leftover may be a live upload "
        "(RLHF_MIN_STAGING_GRACE_S).",
    )

    @model_validator(mode="after")
    def _grace_above_minimum(self) -> StoreSettings:
        if self.staging_grace_s < self.min_staging_grace_s:
            raise ValueError(f"RLHF_STAGING_GRACE_S={self.staging_grace_s:g} is below RLHF_MIN_STAGING_GRACE_S="
                             f"{self.min_staging_grace_s:g}: a live upload could be removed as a leftover")
        return self


class ArtifactError(Exception):
    """Artifact store failure; the message names the URI or file involved."""


class ChecksumError(ArtifactError):
    """A stored or downloaded file does not match its manifest entry; the message names the file."""


class AliasMoved(ArtifactError):
    """A compare-and-swap move of an alias found it pointing elsewhere than expected."""

    def __init__(self, message: str, current: int | None):
        super().__init__(message)
        self.current = current


class StoreUnreachable(ArtifactError):
    """The store kept failing transiently for longer than the retry period: another attempt may succeed."""


class InputRef(BaseModel):
    """An input artifact: the URI of its version directory and its content digest."""

    uri: str
    digest: str


class DatasetRef(BaseModel):
    """A dataset a stage read: its source as configured and a fingerprint of its content
    (stages/fingerprint.py)."""

    source: str
    fingerprint: str


class FileEntry(BaseModel):
    size: int
    sha256: str


class Manifest(BaseModel):
    """What MANIFEST.json holds for one committed version."""

    pipeline: str
    stage: str
    version: int
    uri: str
    created_at: str
    stage_key: str | None = None
    config: dict[str, Any]
    config_hash: str
    inputs: dict[str, InputRef] = {}
    datasets: dict[str, DatasetRef] = {}
    code_version: str = ""
    files: dict[str, FileEntry]
    metrics: dict[str, float | int | str] = {}
    digest: str
    # S3: each stored object's ETag once committed (a rewrite changes it, even at the same size): what a reuse
    # compares without downloading. Empty on a local store (hashed in full) and in manifests written before.
    etags: dict[str, str] = {}

    @field_validator("files")
    @classmethod
    def _names_inside_the_version(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        for rel in files:
            check_relative_name(rel)
        return files

    @field_validator("metrics")
    @classmethod
    def _finite_metrics(cls, metrics: dict[str, float | int | str]) -> dict[str, float | int | str]:
        # Dunder names are the serializers' own (`__exc_type__`, `__class__`): a result holding one would be read
        # back as something else, or not at all.
        odd = [name for name in metrics if name.startswith("__") or len(name) > MAX_METRIC_NAME]
        if odd:
            raise ValueError(f"metric names {', '.join(repr(name[:80]) for name in odd[:5])}: a name may not start "
                             f"with __ or be longer than {MAX_METRIC_NAME} characters")
        bad = [name for name, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)]
        if bad:
            raise ValueError(f"non-finite metric{'s' if len(bad) > 1 else ''} {', '.join(bad)} "
                             f"({', '.join(str(metrics[name]) for name in bad)}): JSON cannot hold them")
        return metrics

    def input_ref(self) -> InputRef:
        """This artifact as an input of a later commit."""
        return InputRef(uri=self.uri, digest=self.digest)


def check_relative_name(rel: str) -> str:
    """`rel` if it names a file inside a version folder: relative, forward slashes, no `.`/`..` or empty parts."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts) or (
            len(rel) > 1 and rel[1] == ":"):
        raise ValueError(f"file name {rel!r} is not a relative path inside the version folder")
    return rel


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def config_hash(config: dict) -> str:
    """sha256 of the config as canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(_canonical_json(config)).hexdigest()


def files_digest(files: dict[str, FileEntry]) -> str:
    """sha256 over the sorted {relpath: [size, sha256]} table: identifies the content, not the version."""
    table = {rel: [entry.size, entry.sha256] for rel, entry in sorted(files.items())}
    return hashlib.sha256(_canonical_json(table)).hexdigest()


def storage_options_from_env(root: str) -> dict:
    """fsspec storage options for ``root``: s3 credentials and endpoint from the AWS_* environment."""
    if fsspec.core.split_protocol(root)[0] not in ("s3", "s3a"):
        return {}
    options: dict[str, Any] = {}
    credentials = {"key": "AWS_ACCESS_KEY_ID", "secret": "AWS_SECRET_ACCESS_KEY", "token": "AWS_SESSION_TOKEN"}
    for option, var in credentials.items():
        if os.environ.get(var):
            options[option] = os.environ[var]
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    # No region here: botocore reads AWS_REGION/AWS_DEFAULT_REGION itself, and an explicit us-east-1 breaks
    # bucket creation.
    return options


def _sha256_stream(stream) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while block := stream.read(_HASH_BLOCK):
        digest.update(block)
        size += len(block)
    return size, digest.hexdigest()


def holds_files_of(source: Path, manifest: Manifest) -> bool:
    """Whether a local folder holds exactly the files a manifest lists, byte for byte (its hashes)."""
    try:
        return _hash_source_tree(source) == manifest.files
    except ArtifactError:
        return False


def _hash_source_tree(source: Path) -> dict[str, FileEntry]:
    if not source.is_dir():
        raise ArtifactError(f"cannot commit {source}: not a directory")
    links = sorted(str(p.relative_to(source)) for p in source.rglob("*") if p.is_symlink())
    if links:  # a link's target lies outside what the commit is meant to hold
        raise ArtifactError(f"cannot commit {source}: symlinks are refused ({', '.join(links)})")
    files = {}
    for path in sorted(p for p in source.rglob("*") if p.is_file()):
        rel = path.relative_to(source).as_posix()
        if rel == MANIFEST_NAME:
            raise ArtifactError(f"cannot commit {source}: {MANIFEST_NAME} is reserved for the store")
        with path.open("rb") as f:
            size, sha = _sha256_stream(f)
        files[rel] = FileEntry(size=size, sha256=sha)
    if not files:
        raise ArtifactError(f"cannot commit {source}: no files")
    return files


def _folders_of(version_path: str, files: Iterable[str]) -> list[str]:
    """The version's folder and every folder under it on the way to one of `files`, deepest first."""
    parts = [rel.split("/")[:-1] for rel in files]
    folders = {version_path} | {"/".join([version_path, *part[:depth]]) for part in parts
                                for depth in range(1, len(part) + 1)}  # fmt: skip
    return sorted(folders, key=lambda folder: -folder.count("/"))


def read_metrics(source: Path) -> dict:
    """A stage output's metrics.json ({} when it has none)."""
    path = source / "metrics.json"
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_METRICS_BYTES:
        raise ArtifactError(f"{path}: {path.stat().st_size} bytes, over the {MAX_METRICS_BYTES} a stage's metrics "
                            "may hold: not read")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: invalid JSON ({e})") from e


def _check_file(name: str, entry: FileEntry, size: int, sha256: str) -> None:
    if size != entry.size:
        raise ChecksumError(f"{name}: size {size} bytes, manifest says {entry.size}")
    if sha256 != entry.sha256:
        raise ChecksumError(f"{name}: sha256 {sha256[:16]}…, manifest says {entry.sha256[:16]}…")


def _etag(info: dict) -> str | None:
    value = info.get("ETag") or info.get("etag")
    return str(value).strip('"') if value else None


def _check_digest(manifest: Manifest) -> None:
    if files_digest(manifest.files) != manifest.digest:
        raise ChecksumError(f"{manifest.uri}/{MANIFEST_NAME}: digest does not match its files table")


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ArtifactError(f"invalid {kind} name {name!r}: use letters, digits, '_', '.', '-'")
    return name


def _version_name(version: int | None) -> str:
    return "nothing" if version is None else f"v{version:04d}"


def version_location(uri: str) -> tuple[str, str, str, int]:
    """(root, pipeline, stage, version) of a version URI ``<root>/<pipeline>/<stage>/vNNNN``."""
    parts = uri.rstrip("/").rsplit("/", 3)
    match = _VERSION_REF.match(parts[-1]) if len(parts) == 4 else None
    if match is None or not parts[-1].startswith("v"):
        raise ArtifactError(f"{uri} is not a version folder <root>/<pipeline>/<stage>/vNNNN")
    return parts[0], parts[1], parts[2], int(match.group(1))


def _short_ref(uri: str) -> str:
    return "/".join(uri.rstrip("/").split("/")[-2:])


# errnos of outages: s3fs raises OSError(EBUSY) for S3 503/SlowDown and OSError(EREMOTEIO) for 500/InternalError
TRANSIENT_ERRNOS = frozenset({errno.EBUSY, getattr(errno, "EREMOTEIO", errno.EIO), errno.ECONNRESET,
                              errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                              errno.ENETUNREACH, errno.ENETDOWN, errno.EPIPE, errno.EAGAIN})
TRANSIENT_S3_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
                                "OperationAborted", "Throttling", "ThrottlingException"})
PERMANENT_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _http_status(error: BaseException) -> int | None:
    """The HTTP status an error carries: requests/httpx/huggingface_hub responses, botocore and aiohttp errors."""
    response = getattr(error, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    status = getattr(response, "status_code", None) or getattr(error, "status", None)
    return status if isinstance(status, int) else None


def _transport_error_types() -> tuple[type, ...]:
    """Connection-level errors of the HTTP stacks the store, the hub and the datasets use."""
    import http.client

    types: list[type] = [ConnectionError, TimeoutError, asyncio.TimeoutError, http.client.HTTPException]
    for module, names in (("aiohttp", ("ClientConnectionError", "ClientPayloadError", "ServerTimeoutError")),
                          ("botocore.exceptions", ("ConnectionError", "HTTPClientError", "ReadTimeoutError")),
                          ("httpx", ("TransportError",)), ("httpx2", ("TransportError",)),
                          ("requests.exceptions", ("ConnectionError", "Timeout")),
                          ("urllib3.exceptions", ("ProtocolError", "TimeoutError"))):  # fmt: skip
        try:
            imported = __import__(module, fromlist=list(names))
        except ImportError:  # not installed: nothing of theirs can be raised either
            continue
        types += [getattr(imported, name) for name in names]
    return tuple(types)


def _unreached(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised while handling, says a server was not reached: huggingface_hub's
    LocalEntryNotFoundError ("cannot find the requested files in the local cache"), which datasets re-raises as
    a FileNotFoundError."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ == "LocalEntryNotFoundError":
            return True
        error = error.__cause__ or error.__context__
    return False


def _verdict(error: BaseException) -> bool | None:
    """True: an outage; False: an answer (missing, forbidden, invalid); None: this error alone does not say."""
    if isinstance(error, PERMANENT_ERRORS):
        return _unreached(error)
    status = _http_status(error)
    code = getattr(error, "response", None)
    code = code.get("Error", {}).get("Code") if isinstance(code, dict) else None
    if code in TRANSIENT_S3_CODES or (status is not None and (status >= 500 or status in (408, 429))):
        return True
    if status is not None and 400 <= status < 500:
        return False
    if isinstance(error, _transport_error_types()):
        return True
    if isinstance(error, OSError) and error.errno in TRANSIENT_ERRNOS:
        return True
    return None


def is_transient(error: BaseException) -> bool:
    """A failure that the same request may not meet again: the endpoint unreachable, a connection cut, a timeout,
    a 5xx or throttling answer (also as the OSErrors s3fs makes of them, and wrapped by datasets or fsspec).

    Missing or existing files, permissions, other 4xx answers and validation errors are answers, not outages:
    never retried. The error's causes are looked at in turn until one of them decides.
    """
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        verdict = _verdict(error)
        if verdict is not None:
            return verdict
        error = error.__cause__ or error.__context__
    return False


def retrying(what: str, operation: Callable[[], T], retry_for_s: float, log: Callable[[str], None],
             where: str = "") -> T:  # fmt: skip
    """``operation()``, repeated with exponential backoff while it fails transiently, up to `retry_for_s`; then
    StoreUnreachable naming `what` (and `where`). Permanent failures are raised at once."""
    started = time.monotonic()
    delay = 1.0
    while True:
        try:
            return operation()
        except Exception as error:
            if not is_transient(error):
                raise
            waited = time.monotonic() - started
            if waited + delay > retry_for_s:
                raise StoreUnreachable(f"{what}: {where or 'the endpoint'} was unreachable for {waited:.0f}s "
                                       f"({type(error).__name__}: {error})") from error
            log(f"{what} failed ({type(error).__name__}: {error}); retrying in {delay:.0f}s")
            time.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF_S)


def file_exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    """Whether `path` exists; unlike fsspec's exists/isfile, which answer False for any error, an outage raises
    (an S3 503 must not read as "no manifest here")."""
    try:
        fs.info(path)
        return True
    except FileNotFoundError:
        return False


def _modified(info: dict) -> float | None:
    """Modification time (epoch seconds) from an fsspec info dict: `mtime` locally, `LastModified` on S3."""
    value = info.get("mtime", info.get("LastModified"))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) if value is not None else None


class ArtifactStore:
    """Versioned, immutable artifacts of one pipeline under ``root`` (a path, file:// or s3:// URI).

    ``retry_for_s``: how long one operation retries transient failures; ``staging_grace_s``: age after which a
    commit removes its stage's leftovers of killed writers (at least ``min_grace_s``); ``log``: where retries,
    clean-ups and unreadable manifests are reported.
    """

    def __init__(self, root: str, pipeline: str, storage_options: dict | None = None, *, retry_for_s: float = 600.0,
                 staging_grace_s: float = 24 * 3600.0, min_grace_s: float = 3600.0,
                 log: Callable[[str], None] | None = None):  # fmt: skip
        options = storage_options_from_env(root) if storage_options is None else dict(storage_options)
        if (fsspec.core.split_protocol(root)[0] or "file") in ("file", "local"):
            options.setdefault("auto_mkdir", True)  # writes create their parent folders, as on S3
        self.storage_options = options
        self.fs, root_path = fsspec.core.url_to_fs(root, **options)
        self.is_local = (fsspec.core.split_protocol(root)[0] or "file") in ("file", "local")
        self.pipeline = _check_name("pipeline", pipeline)
        self.base = f"{root_path.rstrip('/')}/{pipeline}"
        self.retry_for_s = retry_for_s
        self.min_grace_s = min_grace_s
        self.staging_grace_s = self._checked_grace(staging_grace_s)
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))

    def _checked_grace(self, grace_s: float) -> float:
        if grace_s < self.min_grace_s:
            raise ArtifactError(f"a grace period of {grace_s:g}s is below the minimum of {self.min_grace_s:g}s "
                                "(RLHF_MIN_STAGING_GRACE_S): a live upload could be removed as a leftover")
        return grace_s

    # ---- retries -----------------------------------------------------------------------------------------
    def _retrying(self, what: str, operation: Callable[[], T]) -> T:
        """``operation()``, repeated with exponential backoff while it fails transiently, up to retry_for_s."""
        return retrying(what, operation, self.retry_for_s, lambda message: self.log(f"artifact store: {message}"),
                        where=f"the artifact store at {self._uri(self.base)}")

    # ---- paths -------------------------------------------------------------------------------------------
    def _stage_path(self, stage: str) -> str:
        return f"{self.base}/{_check_name('stage', stage)}"

    def _version_path(self, stage: str, version: int) -> str:
        return f"{self._stage_path(stage)}/v{version:04d}"

    def _uri(self, path: str) -> str:
        return self.fs.unstrip_protocol(path)

    def _fs_for(self, uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
        """Filesystem and path for a version URI, which may live in another store (an input's)."""
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        if (fsspec.core.split_protocol(uri)[0] or "file") in protocols:
            return self.fs, self.fs._strip_protocol(uri)
        return fsspec.core.url_to_fs(uri, **storage_options_from_env(uri))

    # ---- writing -----------------------------------------------------------------------------------------
    def commit(
        self,
        stage: str,
        source_dir: str | os.PathLike,
        *,
        config: dict,
        inputs: dict[str, InputRef] | None = None,
        datasets: dict[str, DatasetRef] | None = None,
        code_version: str = "",
        metrics: dict | None = None,
        stage_key: str | None = None,
    ) -> Manifest:
        """Store ``source_dir`` as the next version of ``stage``; metrics default to its metrics.json."""
        source = Path(source_dir)
        stage_path = self._stage_path(stage)
        files = _hash_source_tree(source)
        try:  # validate everything before uploading, so a bad field never costs a version number
            draft = Manifest(
                pipeline=self.pipeline, stage=stage, version=0, uri="", created_at="", stage_key=stage_key,
                config=config, config_hash=config_hash(config), inputs=inputs or {}, datasets=datasets or {},
                code_version=code_version,
                files=files, metrics=read_metrics(source) if metrics is None else metrics,
                digest=files_digest(files),
            )
        except ValidationError as e:
            raise ArtifactError(f"cannot commit {source} as {stage!r}: {e}") from e
        staging = f"{stage_path}/{STAGING}/{uuid.uuid4().hex}"
        try:
            # Explicit file lists: a directory put nests the source folder inside the destination unless the
            # source ends with "/", and would not tell us what it copied. A retry uploads everything again.
            self._retrying(f"upload of {source} to staging", lambda: self.fs.put(
                [str(source / rel) for rel in files],
                [f"{staging}/{rel}" for rel in files],
            ))
            self._sync_local(f"{staging}/{rel}" for rel in files)
            version = self._claim_version(stage_path)
            version_path = self._version_path(stage, version)
            for rel in files:
                self._move(f"{staging}/{rel}", f"{version_path}/{rel}")
            self._sync_local(_folders_of(version_path, files))  # the moves, before the manifest that names them
            manifest = draft.model_copy(update={
                "version": version,
                "uri": self._uri(version_path),
                "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            })
            self._check_files_kept(version_path, files, "before its manifest is written")
            if not self.is_local:
                manifest = manifest.model_copy(update={"etags": self._etags(version_path, files)})
            self._write_atomic(stage_path, f"{version_path}/{MANIFEST_NAME}", manifest.model_dump_json(indent=2))
            self._check_files_kept(version_path, files, "after its manifest was written",
                                   manifest_path=f"{version_path}/{MANIFEST_NAME}")
            self._make_read_only(version_path, [*files, MANIFEST_NAME])
        finally:
            self._remove(staging)
        self._collect_stage_garbage(stage, self.staging_grace_s)
        return manifest

    def _move(self, src: str, dst: str) -> None:
        """Move one file; repeatable: on S3 a move is copy then delete, and either may have happened already."""

        def attempt() -> None:
            try:
                self.fs.mv(src, dst)
            except FileNotFoundError:
                self.fs.invalidate_cache()
                if not file_exists(self.fs, dst):
                    raise

        self._retrying(f"move of {self._uri(src)}", attempt)

    def _claim_version(self, stage_path: str) -> int:
        """Claim the next version number by creating ``_claims/vNNNN.json`` exclusively.

        Exclusive create is O_CREAT|O_EXCL on a local filesystem and a PutObject with ``If-None-Match: *`` on
        S3 (s3fs mode "xb"; AWS S3, MinIO and moto honour it); the loser of a race gets FileExistsError and
        tries the next number. Claims are never deleted, so a writer that dies after claiming leaves a number
        without a manifest: invisible to readers and skipped by later commits, never reused. S3-compatible
        servers that ignore If-None-Match are not safe for concurrent writers.
        """
        claims = f"{stage_path}/_claims"
        # Version folders count too, so a lost _claims folder still cannot lead to writing into a used one.
        used = self._numbers_in(f"{claims}/v*.json") + self._numbers_in(f"{stage_path}/v*")
        version = max(used, default=0) + 1
        for _ in range(_MAX_CLAIM_ATTEMPTS):
            claim = {"version": version, "host": socket.gethostname(), "pid": os.getpid(),
                     "claimed_at": datetime.now(timezone.utc).isoformat()}
            try:
                # A create whose answer was lost and is retried finds its own claim taken: that number then
                # stays unused, as if a killed writer had claimed it.
                self._create_exclusive(f"{claims}/v{version:04d}.json", json.dumps(claim).encode())
                return version
            except FileExistsError:
                version += 1
        raise ArtifactError(f"no free version under {self._uri(claims)} after {_MAX_CLAIM_ATTEMPTS} attempts")

    def _write_atomic(self, stage_path: str, path: str, text: str) -> None:
        """Replace ``path`` in one step: a local rename, or a single S3 copy (PUT) of a finished object."""
        tmp = f"{stage_path}/{STAGING}/{uuid.uuid4().hex}.json"
        self._retrying(f"write of {self._uri(tmp)}", lambda: self.fs.pipe_file(tmp, text.encode()))
        self._sync_local([tmp])
        self._move(tmp, path)
        self._sync_local([path.rsplit("/", 1)[0]])

    def _sync_local(self, paths: Iterable[str]) -> None:
        """On a local store, flush files (their data) or folders (the names moved into them) to disk: a power loss
        after a commit returned must not leave a manifest whose files were still in the page cache. S3 holds an
        object durably once its PUT returned."""
        if not self.is_local:
            return
        for path in paths:
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # taken by a clean-up while this writer was paused: _check_files_kept names it
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)

    def _check_files_kept(self, version_path: str, files: dict[str, FileEntry], when: str,
                          manifest_path: str | None = None) -> None:
        """Every file of the version at its size. A writer paused for longer than the grace period (a suspended
        VM, a stopped process) may have lost its claimed folder to another writer's clean-up, which takes a folder
        without a manifest for a dead writer's: then no manifest may stand for files that are gone. Looked at on
        both sides of the manifest's write, as the clean-up may have been under way; a manifest already written is
        removed again (readers would refuse it anyway: its files are missing)."""
        self.fs.invalidate_cache()
        try:
            found = self._retrying(f"listing of {self._uri(version_path)}", lambda: self.fs.find(version_path,
                                                                                                   detail=True))
        except FileNotFoundError:
            found = {}
        sizes = {name[len(version_path) + 1:]: info.get("size") for name, info in found.items()}
        lost = sorted(rel for rel, entry in files.items() if sizes.get(rel) != entry.size)
        if not lost:
            return
        if manifest_path is not None:
            self._remove(manifest_path)
        raise ArtifactError(
            f"commit of {self._uri(version_path)}: {len(lost)} of its files are gone {when} ({', '.join(lost[:3])}): "
            f"the writer was paused for longer than the store's grace of {self.staging_grace_s:g}s and another "
            "writer's clean-up took its folder for a dead writer's; nothing was committed, commit again")

    def _make_read_only(self, version_path: str, names: Iterable[str]) -> None:
        """On a local store, a committed version's files lose their write permission: a process that opens one for
        writing by mistake (a stage saving into its input model) fails instead of changing a committed version.
        Their folders stay writable, so that removing a store is a plain `rm -r`. On S3, object lock on the bucket
        is the operator's to set (README)."""
        if self.is_local:
            for name in names:
                os.chmod(f"{version_path}/{name}", 0o444)

    def _remove(self, path: str) -> None:
        """Best effort: what cannot be removed now is a leftover for the next clean-up."""
        try:
            self._retrying(f"removal of {self._uri(path)}", lambda: self.fs.rm(path, recursive=True))
        except FileNotFoundError:
            pass
        except ArtifactError as error:
            self.log(f"artifact store: left {self._uri(path)} behind for a later clean-up: {error}")

    # ---- leftovers of killed writers ---------------------------------------------------------------------
    def _newest_change(self, path: str) -> float | None:
        """Latest modification time of anything under ``path`` (a file or a folder)."""
        found = self.fs.find(path, detail=True, withdirs=False)
        times = [t for info in found.values() if (t := _modified(info)) is not None]
        return max(times, default=None)

    def _is_leftover(self, path: str, cutoff: float) -> bool:
        """Whether ``path`` (a staging entry or a version folder) is still a leftover: nothing under it changed
        after ``cutoff``, and a version folder still has no manifest."""
        self.fs.invalidate_cache()
        if _VERSION_PATH.search(path) and file_exists(self.fs, f"{path}/{MANIFEST_NAME}"):
            return False  # its writer finished meanwhile
        changed = self._newest_change(path)
        return changed is None or changed <= cutoff

    def garbage(self, stage: str, grace_s: float) -> list[str]:
        """Paths of leftovers older than ``grace_s``: ``_staging/`` entries and version folders without a
        manifest (claimed by a writer that died before finishing)."""
        stage_path = self._stage_path(stage)
        self.fs.invalidate_cache()
        candidates = []
        try:
            candidates += [e["name"] for e in self.fs.ls(f"{stage_path}/{STAGING}", detail=True)]
        except FileNotFoundError:
            pass
        committed = set(self.versions(stage))
        candidates += [f"{stage_path}/v{n:04d}" for n in self._numbers_in(f"{stage_path}/v*") if n not in committed]
        cutoff = time.time() - grace_s
        return [path.rstrip("/") for path in candidates if self._is_leftover(path.rstrip("/"), cutoff)]

    def collect_garbage(self, stage: str, grace_s: float) -> list[str]:
        """Remove ``garbage(stage, grace_s)``, each path looked at again just before it goes (its writer may have
        come back to it since the listing); returns the URIs removed."""
        grace_s = self._checked_grace(grace_s)
        removed = []
        for path in self._retrying(f"listing of {stage} leftovers", lambda: self.garbage(stage, grace_s)):
            still = self._retrying(f"check of {self._uri(path)}",
                                   lambda: self._is_leftover(path, time.time() - grace_s))  # fmt: skip
            if still:
                self._remove(path)
                removed.append(self._uri(path))
        return removed

    def _collect_stage_garbage(self, stage: str, grace_s: float) -> None:
        """After a commit: clean the stage's old leftovers, never failing the commit that already succeeded."""
        try:
            for uri in self.collect_garbage(stage, grace_s):
                self.log(f"artifact store: removed {uri}, left by a writer that did not finish")
        except Exception as error:  # the commit is done; a failed clean-up is retried by the next one
            self.log(f"artifact store: clean-up of {stage} leftovers failed: {error}")

    def set_alias(self, stage: str, alias: str, version: int, *, expected: int | None | object = ANY) -> None:
        """Point ``alias`` (e.g. "production") at a committed version. With ``expected`` (a version, or None for an
        unset alias) the move is a compare-and-swap: it happens only while the alias points at ``expected``,
        else AliasMoved says where it points. Each move is a record created exclusively (two movers of the same
        alias never both succeed) that remembers the version before it (``previous``)."""
        _check_name("alias", alias)
        if _VERSION_REF.match(alias):
            raise ArtifactError(f"invalid alias name {alias!r}: it reads as a version")
        if version not in self.versions(stage):
            target = self._uri(self._version_path(stage, version))
            raise ArtifactError(f"cannot point alias {alias!r} at {target}: not a committed version")
        moves = f"{self._stage_path(stage)}/{ALIASES}/{alias}"
        while True:
            current, taken = self._alias_moves(stage, alias)
            pointed = None if current is None else current["version"]
            if expected is not ANY and pointed != expected:
                raise AliasMoved(f"alias {alias!r} of {stage} points at {_version_name(pointed)}, not "
                                 f"{_version_name(expected)} as expected: it was moved meanwhile", pointed)
            previous = pointed if pointed != version else (current or {}).get("previous")
            move = max(taken, (current or {}).get("move", 0)) + 1
            record = {"alias": alias, "version": version, "previous": previous, "move": move,
                      "updated_at": datetime.now(timezone.utc).isoformat()}
            try:
                self._create_exclusive(f"{moves}/{record['move']:06d}.json", json.dumps(record).encode())
                return
            except FileExistsError:  # another mover took this move number: look again
                if expected is not ANY:
                    now = self.alias_record(stage, alias)
                    raise AliasMoved(f"alias {alias!r} of {stage} was moved meanwhile (to "
                                     f"{_version_name(now and now['version'])})", now and now["version"]) from None

    def alias_record(self, stage: str, alias: str) -> dict | None:
        """Where ``alias`` points: its newest move record ({"alias", "version", "previous", "move",
        "updated_at"}), or the pointer file of stores written before moves were recorded; None when unset."""
        return self._alias_moves(stage, alias)[0]

    def _alias_moves(self, stage: str, alias: str) -> tuple[dict | None, int]:
        """(the newest readable move record of ``alias``, the newest move number taken). Records appear whole
        (`_create_exclusive`); an unreadable one younger than MOVE_IN_PROGRESS_S (a mover of an older version
        between its create and its write) is read again until it is that old, then skipped with a warning as torn
        (its mover crashed or the disk filled): that move did not happen, and the next one takes the number after
        it. Skipping a record still being written would let a second compare-and-swap from the same version pass."""
        base = f"{self._stage_path(stage)}/{ALIASES}/{_check_name('alias', alias)}"
        self.fs.invalidate_cache()
        try:
            moves = self._retrying(f"listing of {self._uri(base)}", lambda: self.fs.glob(f"{base}/*.json"))
        except FileNotFoundError:
            moves = []
        moves = sorted(moves, key=lambda p: p.rsplit("/", 1)[-1], reverse=True)
        taken = int(moves[0].rsplit("/", 1)[-1].removesuffix(".json")) if moves else 0
        for path in moves or [f"{base}.json"]:
            record = self._read_alias_record(path, pointer_file=not moves)
            if record is not None:
                return record, taken
        return None, taken

    def _read_alias_record(self, path: str, pointer_file: bool) -> dict | None:
        """The record at `path`; None when it is gone or torn (waited for while younger than MOVE_IN_PROGRESS_S).
        `pointer_file`: an older store's single pointer, which has nothing to fall back on when unreadable."""
        while True:
            try:
                record = json.loads(self._retrying(f"read of {self._uri(path)}", lambda: self.fs.cat_file(path)))
                record["version"] = int(record["version"])
                return record
            except FileNotFoundError:
                return None
            except (ValueError, KeyError, TypeError) as e:
                if pointer_file:
                    raise ArtifactError(f"{self._uri(path)}: invalid alias record ({e})") from e
                modified = _modified(self._retrying(f"info of {self._uri(path)}", lambda: self.fs.info(path)))
                if modified is None or time.time() - modified >= MOVE_IN_PROGRESS_S:
                    self.log(f"artifact store: skipping torn alias record {self._uri(path)} ({e}): that move did "
                             "not happen")
                    return None
                time.sleep(0.2)  # its mover may be between creating and writing it

    def _create_exclusive(self, path: str, body: bytes) -> None:
        """Create ``path`` with ``body`` only if it does not exist, whole or not at all: FileExistsError else. On
        S3 one PUT with If-None-Match; locally a hidden temporary file, synced, then hard-linked to the name (an
        exclusive create followed by a write would show readers an empty file in between)."""

        def create() -> None:
            if not self.is_local:
                with self.fs.open(path, "xb") as f:
                    f.write(body)
                return
            local = self.fs._strip_protocol(path)
            tmp = f"{os.path.dirname(local)}/.{os.path.basename(local)}.{uuid.uuid4().hex}.tmp"
            os.makedirs(os.path.dirname(local), exist_ok=True)
            with open(tmp, "xb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, local)
            finally:
                os.unlink(tmp)

        self._retrying(f"create of {self._uri(path)}", create)
        self._sync_local([path.rsplit("/", 1)[0]])  # a claim, an alias move: its name kept across a power loss

    # ---- reading -----------------------------------------------------------------------------------------
    def _numbers_in(self, pattern: str) -> list[int]:
        """Version numbers in the paths matching ``pattern`` (claim files, version folders or manifests)."""
        self.fs.invalidate_cache()  # s3fs caches listings per instance; other writers may have added files
        try:
            found = self._retrying(f"listing of {pattern}", lambda: self.fs.glob(pattern))
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for path in found if (m := _VERSION_PATH.search(path)))

    def versions(self, stage: str) -> list[int]:
        """Committed versions (manifest present), ascending."""
        stage_path = self._stage_path(stage)
        return self._numbers_in(f"{stage_path}/v*/{MANIFEST_NAME}")

    def aliases(self, stage: str) -> dict[str, int]:
        """Alias name -> version, including the derived ``latest`` unless an explicit one exists."""
        folder = f"{self._stage_path(stage)}/{ALIASES}"
        self.fs.invalidate_cache()
        try:
            entries = self._retrying(f"listing of {self._uri(folder)}", lambda: self.fs.ls(folder, detail=False))
        except FileNotFoundError:
            entries = []
        names = sorted({entry.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json") for entry in entries})
        aliases = {name: record["version"] for name in names if _NAME.match(name)
                   and (record := self.alias_record(stage, name)) is not None}
        if LATEST not in aliases and (versions := self.versions(stage)):
            aliases[LATEST] = versions[-1]
        return aliases

    def _resolve(self, stage: str, ref: int | str) -> int:
        if isinstance(ref, int):
            return ref
        if m := _VERSION_REF.match(ref):
            return int(m.group(1))
        aliases = self.aliases(stage)
        if ref not in aliases:
            pointer = self._uri(f"{self._stage_path(stage)}/aliases/{_check_name('alias', ref)}.json")
            detail = " and no committed versions" if ref == LATEST else ""
            raise ArtifactError(f"no alias {ref!r} for stage {stage!r}: {pointer} missing{detail}")
        return aliases[ref]

    def _manifest_at(self, uri: str) -> Manifest:
        """The manifest of the version folder at ``uri``, checked against where it was read: its pipeline, stage
        and version must be those of the folder, its files table must match its digest; its ``uri`` is ``uri``."""
        _, pipeline, stage, version = version_location(uri)
        fs, path = self._fs_for(uri)
        try:
            raw = self._retrying(f"read of {uri}/{MANIFEST_NAME}", lambda: fs.cat_file(f"{path}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            raise ArtifactError(f"{uri} is not a committed version ({MANIFEST_NAME} missing)") from None
        try:
            manifest = Manifest.model_validate_json(raw)
        except ValidationError as e:
            raise ArtifactError(f"{uri}/{MANIFEST_NAME}: invalid manifest ({e})") from e
        claimed = (manifest.pipeline, manifest.stage, manifest.version)
        if claimed != (pipeline, stage, version):
            raise ArtifactError(f"{uri}/{MANIFEST_NAME} describes {claimed[0]}/{claimed[1]} v{claimed[2]:04d}, not "
                                f"the folder it was read from ({pipeline}/{stage} v{version:04d})")
        _check_digest(manifest)
        return manifest.model_copy(update={"uri": uri})

    def get(self, stage: str, ref: int | str = "latest") -> Manifest:
        """Manifest of a committed version; ``ref`` is 3, "v0003" or an alias name."""
        return self._manifest_at(self._uri(self._version_path(stage, self._resolve(stage, ref))))

    def readable(self, stage: str, newest_first: bool = False) -> Iterator[Manifest]:
        """The stage's committed manifests; one that cannot be read is reported through ``log`` and skipped, so
        that one broken version never stops the runs (and listings) that do not need it."""
        versions = self.versions(stage)
        for version in reversed(versions) if newest_first else versions:
            try:
                yield self.get(stage, version)
            except StoreUnreachable:
                raise
            except ArtifactError as error:
                self.log(f"artifact store: skipping unreadable {stage} v{version:04d}: {error}")

    def find_by_stage_key(self, stage: str, stage_key: str) -> Manifest | None:
        """Newest committed manifest with this stage key (for idempotent re-runs), quarantined ones left out, or
        None."""
        quarantined = self.quarantined(stage)
        return next((m for m in self.readable(stage, newest_first=True)
                     if m.stage_key == stage_key and m.version not in quarantined), None)  # fmt: skip

    def quarantined(self, stage: str) -> dict[int, str]:
        """{version: why} of the stage's versions found damaged."""
        folder = f"{self._stage_path(stage)}/_quarantine"
        records = {}
        for version in self._numbers_in(f"{folder}/v*.json"):
            try:
                path = f"{folder}/v{version:04d}.json"
                records[version] = json.loads(self._retrying(f"read of {self._uri(path)}",
                                                             lambda: self.fs.cat_file(path)))["why"]
            except (ValueError, KeyError, TypeError):  # a torn record still quarantines its version
                records[version] = "(record unreadable)"
        return records

    def quarantine(self, stage: str, version: int, why: str) -> None:
        """Set a damaged version aside: reuse skips it, listings say why. Its files stay, for a look at them."""
        record = {"version": version, "why": why, "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        try:
            self._create_exclusive(f"{self._stage_path(stage)}/_quarantine/v{version:04d}.json",
                                   json.dumps(record).encode())  # fmt: skip
        except FileExistsError:
            pass  # quarantined already, by another run that found it damaged too

    def verify_for_reuse(self, manifest: Manifest) -> None:
        """Check a version before a run reuses it instead of building it: every hash on a local store, where
        reading is cheap; on S3 every file present at its recorded size and, where the manifest recorded them,
        with the ETag it had when committed (a full re-hash would download it all)."""
        if self.is_local:
            self.verify(manifest)
            return
        _, path, found = self._stored(manifest)
        stored = {name[len(path) + 1:]: info for name, info in found.items()}
        for rel, entry in manifest.files.items():
            if rel not in stored:
                raise ChecksumError(f"{manifest.uri}/{rel}: missing")
            size = stored[rel].get("size")
            if size != entry.size:
                raise ChecksumError(f"{manifest.uri}/{rel}: {size} bytes, the manifest recorded {entry.size}")
            if rel in manifest.etags and _etag(stored[rel]) != manifest.etags[rel]:
                raise ChecksumError(f"{manifest.uri}/{rel}: the stored object was rewritten since its commit (ETag "
                                    f"{_etag(stored[rel])}, recorded {manifest.etags[rel]})")

    def _etags(self, version_path: str, files: dict[str, FileEntry]) -> dict[str, str]:
        """The ETags of a version's stored objects, as S3 lists them."""
        self.fs.invalidate_cache()
        found = self._retrying(f"listing of {self._uri(version_path)}",
                               lambda: self.fs.find(version_path, detail=True))
        etags = {name[len(version_path) + 1:]: _etag(info) for name, info in found.items()}
        return {rel: etags[rel] for rel in files if etags.get(rel)}

    def read_file(self, manifest: Manifest, rel: str, max_bytes: int | None = None) -> bytes:
        """One file of a committed version, checked against its manifest entry; with `max_bytes`, refused unread
        when its manifest entry is larger (a file a job wrote, parsed by the worker)."""
        if rel not in manifest.files:
            raise ArtifactError(f"{manifest.uri} has no file {rel!r}")
        if max_bytes is not None and manifest.files[rel].size > max_bytes:
            raise ArtifactError(f"{manifest.uri}/{rel} holds {manifest.files[rel].size} bytes, over the "
                                f"{max_bytes} read of it: not read")
        fs, path = self._fs_for(manifest.uri)
        data = self._retrying(f"read of {manifest.uri}/{rel}", lambda: fs.cat_file(f"{path}/{rel}"))
        _check_file(f"{manifest.uri}/{rel}", manifest.files[rel], len(data), hashlib.sha256(data).hexdigest())
        return data

    def download(self, manifest: Manifest, dest_dir: str | os.PathLike, verify: bool = True) -> Path:
        """Copy the version's files into ``dest_dir`` (transient failures retried); with ``verify`` check each
        against the manifest."""
        if verify:
            _check_digest(manifest)
        dest = Path(dest_dir).resolve()
        fs, path = self._fs_for(manifest.uri)
        rels = list(manifest.files)
        for rel in rels:
            if not (dest / rel).resolve().is_relative_to(dest):
                raise ArtifactError(f"{manifest.uri}: file {rel!r} would be written outside {dest}")
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._retrying(f"download of {manifest.uri}", lambda: fs.get([f"{path}/{rel}" for rel in rels],
                                                                       [str(dest / rel) for rel in rels]))
        except FileNotFoundError as e:
            raise ChecksumError(f"{manifest.uri}: file listed in the manifest is missing ({e})") from e
        if verify:
            self.verify_copy(manifest, dest)
        return dest

    def verify_copy(self, manifest: Manifest, local_dir: str | os.PathLike) -> None:
        """Re-hash a local copy of the version; raises ChecksumError naming the first file that differs."""
        local = Path(local_dir)
        for rel, entry in manifest.files.items():
            try:
                with (local / rel).open("rb") as f:
                    _check_file(f"{manifest.uri}/{rel} (copy in {local / rel})", entry, *_sha256_stream(f))
            except FileNotFoundError:
                raise ChecksumError(f"{manifest.uri}/{rel}: missing from the copy in {local}") from None

    def _stored(self, manifest: Manifest) -> tuple[Any, str, dict[str, dict]]:
        """(filesystem, path, {stored path: info} of files and folders) of a version, its digest checked first."""
        _check_digest(manifest)
        fs, path = self._fs_for(manifest.uri)
        fs.invalidate_cache()
        return fs, path, self._retrying(f"listing of {manifest.uri}", lambda: fs.find(path, detail=True, withdirs=True))

    def verify(self, manifest: Manifest) -> None:
        """Re-hash the stored files; raises ChecksumError naming the first file that differs, a file the manifest
        does not list, or a symlink in the version folder."""
        fs, path, found = self._stored(manifest)
        links = sorted(name for name, info in found.items() if info.get("islink"))
        if links:
            raise ChecksumError(f"{manifest.uri}: symlinks in the version folder: "
                                + ", ".join(name[len(path) + 1:] for name in links))
        stored = {name[len(path) + 1:] for name, info in found.items() if info.get("type") != "directory"}
        unlisted = sorted(stored - set(manifest.files) - {MANIFEST_NAME})
        if unlisted:
            raise ChecksumError(f"{manifest.uri}: files the manifest does not list: {', '.join(unlisted)}")
        for rel, entry in manifest.files.items():
            try:
                with fs.open(f"{path}/{rel}", "rb") as f:
                    _check_file(f"{manifest.uri}/{rel}", entry, *_sha256_stream(f))
            except FileNotFoundError:
                raise ChecksumError(f"{manifest.uri}/{rel}: missing") from None

    def lineage(self, stage: str, ref: int | str = "latest") -> list[Manifest]:
        """This artifact, then its inputs recursively (breadth first, each once); checks input digests. Inputs of
        this store's root are read from it, wherever the store was when they were recorded."""
        chain = [self.get(stage, ref)]
        seen = {chain[0].uri}
        for manifest in chain:  # grows while iterating
            for name, ref_in in manifest.inputs.items():
                _, pipeline, input_stage, version = version_location(ref_in.uri)
                uri = self._uri(f"{self.base.rsplit('/', 1)[0]}/{pipeline}/{input_stage}/v{version:04d}")
                if uri in seen:
                    continue
                parent = self._manifest_at(uri)
                if parent.digest != ref_in.digest:
                    raise ArtifactError(f"input {name!r} of {manifest.uri} expects digest {ref_in.digest[:12]}, "
                                        f"{ref_in.uri} has {parent.digest[:12]}")
                seen.add(uri)
                chain.append(parent)
        return chain

    def stages(self) -> list[str]:
        """Stage folders of this pipeline."""
        self.fs.invalidate_cache()
        try:
            entries = self.fs.ls(self.base, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def listing(self) -> str:
        """Human table of every committed version: stage, version, aliases, created, digest, inputs; a version
        whose manifest cannot be read says so in place of its fields."""
        rows = [("stage", "version", "aliases", "created", "digest", "inputs")]
        for stage in self.stages():
            by_version: dict[int, list[str]] = {}
            for alias, version in self.aliases(stage).items():
                by_version.setdefault(version, []).append(alias)
            readable = {m.version: m for m in self.readable(stage)}
            quarantined = self.quarantined(stage)
            for version in self.versions(stage):
                aliases = ",".join(sorted(by_version.get(version, []))) or "-"
                if (m := readable.get(version)) is None:
                    rows.append((stage, f"v{version:04d}", aliases, "UNREADABLE", "-", "see the message above"))
                    continue
                if version in quarantined:
                    rows.append((stage, f"v{version:04d}", aliases, "QUARANTINED", m.digest[:12], quarantined[version]))
                    continue
                inputs = ", ".join(f"{name}={_short_ref(ref.uri)}" for name, ref in sorted(m.inputs.items()))
                rows.append((stage, f"v{version:04d}", aliases, m.created_at, m.digest[:12], inputs or "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                         for row in rows)


def open_store(root: str, pipeline: str, log: Callable[[str], None] | None = None) -> ArtifactStore:
    """Store at ``root`` with storage options from the environment (AWS_* for s3://) and retry/clean-up
    periods from the settings (RLHF_ARTIFACT_RETRY_S, RLHF_STAGING_GRACE_S)."""
    settings = StoreSettings()
    return ArtifactStore(root, pipeline, storage_options_from_env(root), retry_for_s=settings.artifact_retry_s,
                         staging_grace_s=settings.staging_grace_s, min_grace_s=settings.min_staging_grace_s, log=log)


def is_version_folder(location: str) -> bool:
    """Whether a model location (a path, file:// or s3:// URI) is a committed version: its manifest is there."""
    if fsspec.core.split_protocol(location)[0] not in (None, "file", "local", "s3", "s3a"):
        return False
    fs, path = fsspec.core.url_to_fs(location, **storage_options_from_env(location))
    settings = StoreSettings()
    return retrying(f"look-up of {location}/{MANIFEST_NAME}",
                    lambda: file_exists(fs, f"{path.rstrip('/')}/{MANIFEST_NAME}"), settings.artifact_retry_s,
                    lambda message: print(f"artifact store: {message}", file=sys.stderr))


def open_version(location: str, log: Callable[[str], None] | None = None) -> tuple[ArtifactStore, Manifest]:
    """The store and checked manifest of the committed version at ``location`` (a path, file:// or s3:// URI of
    ``<root>/<pipeline>/<stage>/vNNNN``)."""
    if "://" not in location:
        location = Path(location).expanduser().resolve().as_uri()
    root, pipeline, stage, version = version_location(location)
    store = open_store(root, pipeline, log=log)
    return store, store._manifest_at(store._uri(store._version_path(stage, version)))


def pipelines(root: str) -> list[str]:
    """Pipeline folders under ``root``."""
    fs, root_path = fsspec.core.url_to_fs(root, **storage_options_from_env(root))
    try:
        entries = fs.ls(root_path, detail=True)
    except FileNotFoundError:
        return []
    names = (e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")
    return sorted(name for name in names if _NAME.match(name))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.artifacts", description="Inspect and tidy an artifact store.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="every committed version of a pipeline")
    listing.add_argument("root")
    listing.add_argument("pipeline")
    verify = commands.add_parser("verify", help="re-hash every file of every committed version (or one stage's)")
    verify.add_argument("root")
    verify.add_argument("pipeline")
    verify.add_argument("--stage")
    gc = commands.add_parser("gc", help="remove leftovers of killed writers (_staging/, versions without manifest)")
    gc.add_argument("root")
    gc.add_argument("--pipeline", help="only this pipeline (default: all under root)")
    gc.add_argument("--grace-s", type=float, help="only leftovers older than this (default: RLHF_STAGING_GRACE_S)")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            print(open_store(args.root, args.pipeline).listing())
            return 0
        if args.command == "verify":
            return verify_command(args.root, args.pipeline, args.stage)
        for pipeline in [args.pipeline] if args.pipeline else pipelines(args.root):
            store = open_store(args.root, pipeline)
            grace_s = store.staging_grace_s if args.grace_s is None else args.grace_s
            for stage in store.stages():
                for uri in store.collect_garbage(stage, grace_s):
                    print(f"removed {uri}")
    except (ArtifactError, ValidationError) as error:  # ValidationError: RLHF_* settings out of range
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def verify_command(root: str, pipeline: str, only_stage: str | None) -> int:
    """`verify`: one line per version, ok / FAILED (a file differs) / UNREADABLE (its manifest); 1 if any is not ok."""
    unreadable: list[str] = []
    store = open_store(root, pipeline, log=unreadable.append)
    failed = 0
    for stage in [only_stage] if only_stage else store.stages():
        for manifest in store.readable(stage):
            try:
                store.verify(manifest)
                print(f"ok      {manifest.uri} ({len(manifest.files)} files)")
            except ChecksumError as error:
                failed += 1
                print(f"FAILED  {error}")
        for message in unreadable:
            print(f"UNREADABLE  {message.removeprefix('artifact store: skipping unreadable ')}")
        failed += len(unreadable)
        unreadable.clear()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
