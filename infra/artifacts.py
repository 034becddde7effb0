"""Versioned artifact store over fsspec: plain paths / file:// by default, s3:// through s3fs.

Layout under ``<root>/<pipeline>/<stage>/``::

    v0001/...             payload files, then MANIFEST.json written last: a version exists iff its manifest does
    aliases/<name>.json   pointer files {"alias": name, "version": n}, replaced atomically
    _claims/v0001.json    version claims, created exclusively; never overwritten, never deleted
    _staging/<token>/     uploads in flight; moved into the claimed version directory

A commit uploads into a private staging prefix, claims the next free version number by exclusive create,
moves the staged files into that version directory and writes MANIFEST.json last. Every operation goes
through the same fsspec calls for both backends; only the storage options differ.

Transient failures (endpoint unreachable, connection reset, timeouts) are retried with exponential backoff for
up to `retry_for_s`; each step is safe to repeat, so an outage in the middle of a commit delays it and leaves no
partial version. What a killed writer leaves behind (a `_staging/` entry, a claimed version directory without a
manifest) is invisible to readers and removed once older than `staging_grace_s`, by the next commit of that
stage or by `python -m infra.artifacts gc <root>`.

    python -m infra.artifacts list <root> <pipeline>
    python -m infra.artifacts verify <root> <pipeline> [--stage STAGE]
    python -m infra.artifacts gc <root> [--pipeline PIPELINE] [--grace-s SECONDS]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import socket
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from pydantic import BaseModel, Field, ValidationError
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


class ArtifactError(Exception):
    """Artifact store failure; the message names the URI or file involved."""


class ChecksumError(ArtifactError):
    """A stored or downloaded file does not match its manifest entry; the message names the file."""


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

    def input_ref(self) -> InputRef:
        """This artifact as an input of a later commit."""
        return InputRef(uri=self.uri, digest=self.digest)


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


def _hash_source_tree(source: Path) -> dict[str, FileEntry]:
    if not source.is_dir():
        raise ArtifactError(f"cannot commit {source}: not a directory")
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


def read_metrics(source: Path) -> dict:
    """A stage output's metrics.json ({} when it has none)."""
    path = source / "metrics.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: invalid JSON ({e})") from e


def _check_file(name: str, entry: FileEntry, size: int, sha256: str) -> None:
    if size != entry.size:
        raise ChecksumError(f"{name}: size {size} bytes, manifest says {entry.size}")
    if sha256 != entry.sha256:
        raise ChecksumError(f"{name}: sha256 {sha256[:16]}…, manifest says {entry.sha256[:16]}…")


def _check_digest(manifest: Manifest) -> None:
    if files_digest(manifest.files) != manifest.digest:
        raise ChecksumError(f"{manifest.uri}/{MANIFEST_NAME}: digest does not match its files table")


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ArtifactError(f"invalid {kind} name {name!r}: use letters, digits, '_', '.', '-'")
    return name


def _short_ref(uri: str) -> str:
    return "/".join(uri.rstrip("/").split("/")[-2:])


def is_transient(error: BaseException) -> bool:
    """A failure that the same request may not meet again: the endpoint unreachable, a connection cut, a timeout.

    Missing or existing files, permissions and validation errors are answers, not outages: never retried.
    """
    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                          NotADirectoryError)):  # fmt: skip
        return False
    if isinstance(error, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    try:
        import aiohttp
        import botocore.exceptions as boto
    except ImportError:  # no S3 support installed: nothing of theirs can be raised either
        return False
    return isinstance(error, (boto.ConnectionError, boto.HTTPClientError, aiohttp.ClientError))


def _modified(info: dict) -> float | None:
    """Modification time (epoch seconds) from an fsspec info dict: `mtime` locally, `LastModified` on S3."""
    value = info.get("mtime", info.get("LastModified"))
    if isinstance(value, datetime):
        return value.timestamp()
    return float(value) if value is not None else None


class ArtifactStore:
    """Versioned, immutable artifacts of one pipeline under ``root`` (a path, file:// or s3:// URI).

    ``retry_for_s``: how long one operation retries transient failures; ``staging_grace_s``: age after which a
    commit removes its stage's leftovers of killed writers; ``log``: where retries and clean-ups are reported.
    """

    def __init__(self, root: str, pipeline: str, storage_options: dict | None = None, *, retry_for_s: float = 600.0,
                 staging_grace_s: float = 24 * 3600.0, log: Callable[[str], None] | None = None):  # fmt: skip
        options = storage_options_from_env(root) if storage_options is None else dict(storage_options)
        if (fsspec.core.split_protocol(root)[0] or "file") in ("file", "local"):
            options.setdefault("auto_mkdir", True)  # writes create their parent folders, as on S3
        self.storage_options = options
        self.fs, root_path = fsspec.core.url_to_fs(root, **options)
        self.pipeline = _check_name("pipeline", pipeline)
        self.base = f"{root_path.rstrip('/')}/{pipeline}"
        self.retry_for_s = retry_for_s
        self.staging_grace_s = staging_grace_s
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))

    # ---- retries -----------------------------------------------------------------------------------------
    def _retrying(self, what: str, operation: Callable[[], T]) -> T:
        """``operation()``, repeated with exponential backoff while it fails transiently, up to retry_for_s."""
        started = time.monotonic()
        delay = 1.0
        while True:
            try:
                return operation()
            except Exception as error:
                if not is_transient(error):
                    raise
                waited = time.monotonic() - started
                if waited + delay > self.retry_for_s:
                    raise ArtifactError(
                        f"{what}: the artifact store at {self._uri(self.base)} was unreachable for {waited:.0f}s "
                        f"({type(error).__name__}: {error})"
                    ) from error
                self.log(f"artifact store: {what} failed ({type(error).__name__}: {error}); "
                         f"retrying in {delay:.0f}s")
                time.sleep(delay)
                delay = min(delay * 2, _MAX_BACKOFF_S)

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
            version = self._claim_version(stage_path)
            version_path = self._version_path(stage, version)
            for rel in files:
                self._move(f"{staging}/{rel}", f"{version_path}/{rel}")
            manifest = draft.model_copy(update={
                "version": version,
                "uri": self._uri(version_path),
                "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            })
            self._write_atomic(stage_path, f"{version_path}/{MANIFEST_NAME}", manifest.model_dump_json(indent=2))
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
                if not self.fs.exists(dst):
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

            def create(path: str = f"{claims}/v{version:04d}.json", body: bytes = json.dumps(claim).encode()):
                with self.fs.open(path, "xb") as f:
                    f.write(body)

            try:
                # A create whose answer was lost and is retried finds its own claim taken: that number then
                # stays unused, as if a killed writer had claimed it.
                self._retrying(f"claim of v{version:04d}", create)
                return version
            except FileExistsError:
                version += 1
        raise ArtifactError(f"no free version under {self._uri(claims)} after {_MAX_CLAIM_ATTEMPTS} attempts")

    def _write_atomic(self, stage_path: str, path: str, text: str) -> None:
        """Replace ``path`` in one step: a local rename, or a single S3 copy (PUT) of a finished object."""
        tmp = f"{stage_path}/{STAGING}/{uuid.uuid4().hex}.json"
        self._retrying(f"write of {self._uri(tmp)}", lambda: self.fs.pipe_file(tmp, text.encode()))
        self._move(tmp, path)

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
        old = []
        for path in candidates:
            changed = self._newest_change(path)
            if changed is None or changed <= cutoff:
                old.append(path.rstrip("/"))
        return old

    def collect_garbage(self, stage: str, grace_s: float) -> list[str]:
        """Remove ``garbage(stage, grace_s)``; returns the URIs removed."""
        removed = []
        for path in self._retrying(f"listing of {stage} leftovers", lambda: self.garbage(stage, grace_s)):
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

    def set_alias(self, stage: str, alias: str, version: int) -> None:
        """Point ``alias`` (e.g. "production") at a committed version; the pointer file moves atomically and
        remembers the version it pointed at before (``previous``), so a promotion can be traced back."""
        _check_name("alias", alias)
        if _VERSION_REF.match(alias):
            raise ArtifactError(f"invalid alias name {alias!r}: it reads as a version")
        if version not in self.versions(stage):
            target = self._uri(self._version_path(stage, version))
            raise ArtifactError(f"cannot point alias {alias!r} at {target}: not a committed version")
        stage_path = self._stage_path(stage)
        current = self.alias_record(stage, alias)
        if current is None:
            previous = None
        else:
            previous = current["version"] if current["version"] != version else current.get("previous")
        pointer = {"alias": alias, "version": version, "previous": previous,
                   "updated_at": datetime.now(timezone.utc).isoformat()}
        self._write_atomic(stage_path, f"{stage_path}/aliases/{alias}.json", json.dumps(pointer))

    def alias_record(self, stage: str, alias: str) -> dict | None:
        """The pointer file of ``alias`` ({"alias", "version", "previous", "updated_at"}), or None when unset."""
        path = f"{self._stage_path(stage)}/aliases/{_check_name('alias', alias)}.json"
        self.fs.invalidate_cache()
        try:
            raw = self._retrying(f"read of {self._uri(path)}", lambda: self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        try:
            record = json.loads(raw)
            record["version"] = int(record["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise ArtifactError(f"{self._uri(path)}: invalid alias pointer ({e})") from e
        return record

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
        stage_path = self._stage_path(stage)
        self.fs.invalidate_cache()
        paths = self.fs.glob(f"{stage_path}/aliases/*.json")
        pointers = self.fs.cat(paths) if paths else {}
        aliases = {}
        for path, raw in sorted(pointers.items()):
            try:
                aliases[path.rsplit("/", 1)[-1].removesuffix(".json")] = int(json.loads(raw)["version"])
            except (ValueError, KeyError, TypeError) as e:
                raise ArtifactError(f"{self._uri(path)}: invalid alias pointer ({e})") from e
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
        fs, path = self._fs_for(uri)
        try:
            raw = self._retrying(f"read of {uri}/{MANIFEST_NAME}", lambda: fs.cat_file(f"{path}/{MANIFEST_NAME}"))
        except FileNotFoundError:
            raise ArtifactError(f"{uri} is not a committed version ({MANIFEST_NAME} missing)") from None
        try:
            return Manifest.model_validate_json(raw)
        except ValidationError as e:
            raise ArtifactError(f"{uri}/{MANIFEST_NAME}: invalid manifest ({e})") from e

    def get(self, stage: str, ref: int | str = "latest") -> Manifest:
        """Manifest of a committed version; ``ref`` is 3, "v0003" or an alias name."""
        return self._manifest_at(self._uri(self._version_path(stage, self._resolve(stage, ref))))

    def find_by_stage_key(self, stage: str, stage_key: str) -> Manifest | None:
        """Newest committed manifest with this stage key (for idempotent re-runs), or None."""
        for version in reversed(self.versions(stage)):
            manifest = self.get(stage, version)
            if manifest.stage_key == stage_key:
                return manifest
        return None

    def read_file(self, manifest: Manifest, rel: str) -> bytes:
        """One file of a committed version, checked against its manifest entry."""
        if rel not in manifest.files:
            raise ArtifactError(f"{manifest.uri} has no file {rel!r}")
        fs, path = self._fs_for(manifest.uri)
        data = self._retrying(f"read of {manifest.uri}/{rel}", lambda: fs.cat_file(f"{path}/{rel}"))
        _check_file(f"{manifest.uri}/{rel}", manifest.files[rel], len(data), hashlib.sha256(data).hexdigest())
        return data

    def download(self, manifest: Manifest, dest_dir: str | os.PathLike, verify: bool = True) -> Path:
        """Copy the version's files into ``dest_dir``; with ``verify`` check each against the manifest."""
        if verify:
            _check_digest(manifest)
        dest = Path(dest_dir)
        fs, path = self._fs_for(manifest.uri)
        rels = list(manifest.files)
        for rel in rels:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            fs.get([f"{path}/{rel}" for rel in rels], [str(dest / rel) for rel in rels])
        except FileNotFoundError as e:
            raise ArtifactError(f"{manifest.uri}: file listed in the manifest is missing ({e})") from e
        if verify:
            for rel, entry in manifest.files.items():
                with (dest / rel).open("rb") as f:
                    _check_file(f"{manifest.uri}/{rel} (downloaded to {dest / rel})", entry, *_sha256_stream(f))
        return dest

    def verify(self, manifest: Manifest) -> None:
        """Re-hash the stored files; raises ChecksumError naming the first file that differs."""
        _check_digest(manifest)
        fs, path = self._fs_for(manifest.uri)
        for rel, entry in manifest.files.items():
            try:
                with fs.open(f"{path}/{rel}", "rb") as f:
                    _check_file(f"{manifest.uri}/{rel}", entry, *_sha256_stream(f))
            except FileNotFoundError:
                raise ChecksumError(f"{manifest.uri}/{rel}: missing") from None

    def lineage(self, stage: str, ref: int | str = "latest") -> list[Manifest]:
        """This artifact, then its inputs recursively (breadth first, each once); checks input digests."""
        chain = [self.get(stage, ref)]
        seen = {chain[0].uri}
        for manifest in chain:  # grows while iterating
            for name, ref_in in manifest.inputs.items():
                if ref_in.uri in seen:
                    continue
                parent = self._manifest_at(ref_in.uri)
                if parent.digest != ref_in.digest:
                    raise ArtifactError(f"input {name!r} of {manifest.uri} expects digest {ref_in.digest[:12]}, "
                                        f"{ref_in.uri} has {parent.digest[:12]}")
                seen.add(ref_in.uri)
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
        """Human table of every committed version: stage, version, aliases, created, digest, inputs."""
        rows = [("stage", "version", "aliases", "created", "digest", "inputs")]
        for stage in self.stages():
            by_version: dict[int, list[str]] = {}
            for alias, version in self.aliases(stage).items():
                by_version.setdefault(version, []).append(alias)
            for version in self.versions(stage):
                m = self.get(stage, version)
                inputs = ", ".join(f"{name}={_short_ref(ref.uri)}" for name, ref in sorted(m.inputs.items()))
                rows.append((stage, f"v{version:04d}", ",".join(sorted(by_version.get(version, []))) or "-",
                             m.created_at, m.digest[:12], inputs or "-"))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                         for row in rows)


def open_store(root: str, pipeline: str, log: Callable[[str], None] | None = None) -> ArtifactStore:
    """Store at ``root`` with storage options from the environment (AWS_* for s3://) and retry/clean-up
    periods from the settings (RLHF_ARTIFACT_RETRY_S, RLHF_STAGING_GRACE_S)."""
    settings = StoreSettings()
    return ArtifactStore(root, pipeline, storage_options_from_env(root), retry_for_s=settings.artifact_retry_s,
                         staging_grace_s=settings.staging_grace_s, log=log)


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

    if args.command == "list":
        print(open_store(args.root, args.pipeline).listing())
        return 0
    if args.command == "verify":
        store = open_store(args.root, args.pipeline)
        failed = 0
        for stage in [args.stage] if args.stage else store.stages():
            for version in store.versions(stage):
                manifest = store.get(stage, version)
                try:
                    store.verify(manifest)
                    print(f"ok      {manifest.uri} ({len(manifest.files)} files)")
                except ChecksumError as error:
                    failed += 1
                    print(f"FAILED  {error}")
        return 1 if failed else 0
    for pipeline in [args.pipeline] if args.pipeline else pipelines(args.root):
        store = open_store(args.root, pipeline)
        grace_s = store.staging_grace_s if args.grace_s is None else args.grace_s
        for stage in store.stages():
            for uri in store.collect_garbage(stage, grace_s):
                print(f"removed {uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
