"""Artifact store: every store test runs on a local folder and on a moto S3 endpoint (see conftest.store_root)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import pytest

from infra import artifacts
from infra.artifacts import (
    MANIFEST_NAME,
    AliasMoved,
    ArtifactError,
    ArtifactStore,
    ChecksumError,
    config_hash,
    open_store,
)

from conftest import replace_stored

REPO = Path(__file__).resolve().parents[1]

# A writer in its own interpreter: prints "ready", waits for the go file (if any), commits, prints the version.
# With pause_at "upload:N" it stalls once N files reached its staging area, with "move:N" once N files were moved
# into the version it claimed, printing "paused at ...": a test kills it there.
WRITER = """
import json, os, sys, time
from infra.artifacts import open_store
root, stage, source, tag, go_file, pause_at = sys.argv[1:]
store = open_store(root, "pipe")
if pause_at:
    step, count = pause_at.split(":")
    count = int(count)

    def park():
        print("paused at", pause_at, flush=True)
        time.sleep(3600)

    if step == "upload":
        put = store.fs.put

        def partial_put(sources, targets, **kwargs):
            put(sources[:count], targets[:count])
            park()

        store.fs.put = partial_put
    else:
        move, moved = store._move, []

        def counting_move(src, dst):
            move(src, dst)
            moved.append(dst)
            if len(moved) == count:
                park()

        store._move = counting_move
print("ready", flush=True)
while go_file and not os.path.exists(go_file):
    time.sleep(0.005)
manifest = store.commit(stage, source, config={"writer": tag}, metrics={"writer": tag})
print("committed", manifest.version, flush=True)
"""


def make_source(path: Path, tag: str, n_files: int = 3, size: int = 1000) -> Path:
    """A model-like folder whose content depends on ``tag``."""
    (path / "tokenizer").mkdir(parents=True)
    for i in range(n_files):
        (path / f"weights-{i}.bin").write_bytes(hashlib.sha256(f"{tag}-{i}".encode()).digest() * (size // 32))
    (path / "tokenizer" / "vocab.json").write_text(json.dumps({"tag": tag}))
    (path / "metrics.json").write_text(json.dumps({"loss": 0.25, "steps": 7}))
    return path


def tree_bytes(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def start_writer(root: str, stage: str, source: Path, tag: str, log_dir: Path, go_file: str = "",
                 pause_at: str = ""):
    out = (log_dir / f"{tag}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, root, stage, str(source), tag, go_file, pause_at],
        cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
    )
    return proc, log_dir / f"{tag}.log"


def wait_for_line(log: Path, marker: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    # Four writers importing the store at once beside the suite's other worker can take over a minute on 2 cores.
    deadline = time.monotonic() + timeout_s
    while marker not in log.read_text():
        if proc.poll() is not None:
            raise AssertionError(f"writer exited with {proc.returncode} before {marker!r}: {log.read_text()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {marker!r} from writer within {timeout_s}s: {log.read_text()}")
        time.sleep(0.02)


def test_commit_get_and_manifest_fields(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    source = make_source(tmp_path / "src", "a")
    config = {"learning_rate": 1e-5, "zero_stage": 2, "nested": {"b": [1, 2]}}

    first = store.commit("sft", source, config=config, code_version="abc123", stage_key="key-1")

    assert (first.pipeline, first.stage, first.version, first.stage_key) == ("pipe", "sft", 1, "key-1")
    assert first.uri.endswith("/pipe/sft/v0001") and first.uri.split("://")[0] in ("file", "s3")
    assert datetime.fromisoformat(first.created_at).tzinfo is not None
    assert first.config == config and first.config_hash == config_hash(config)
    assert first.code_version == "abc123" and first.inputs == {}
    assert first.metrics == {"loss": 0.25, "steps": 7}  # read from the source's metrics.json
    expected = tree_bytes(source)
    assert set(first.files) == set(expected)
    for rel, data in expected.items():
        assert first.files[rel].size == len(data)
        assert first.files[rel].sha256 == hashlib.sha256(data).hexdigest()

    second = store.commit("sft", source, config=config, inputs={"base": first.input_ref()}, metrics={"acc": 0.5})
    assert second.version == 2 and second.digest == first.digest  # digest identifies content, not version
    assert second.metrics == {"acc": 0.5} and second.inputs["base"].uri == first.uri

    assert store.versions("sft") == [1, 2]
    assert store.get("sft") == second
    assert store.get("sft", 1) == first and store.get("sft", "v0001") == first
    assert store.find_by_stage_key("sft", "key-1") == first
    assert store.find_by_stage_key("sft", "missing") is None

    downloaded = store.download(first, tmp_path / "dl")
    assert tree_bytes(downloaded) == expected
    store.verify(second)

    stored = json.loads(store.fs.cat_file(f"{store.fs._strip_protocol(first.uri)}/{MANIFEST_NAME}"))
    assert stored["config_hash"] == first.config_hash and stored["files"]["tokenizer/vocab.json"]["size"] > 0


def test_bad_refs_and_sources_are_errors_naming_them(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    with pytest.raises(ArtifactError, match="latest"):
        store.get("sft")
    store.commit("sft", make_source(tmp_path / "src", "a"), config={})
    with pytest.raises(ArtifactError, match="production"):
        store.get("sft", "production")
    with pytest.raises(ArtifactError, match="sft/v0007"):
        store.get("sft", 7)
    with pytest.raises(ArtifactError, match="not a directory"):
        store.commit("sft", tmp_path / "nowhere", config={})
    with pytest.raises(ArtifactError, match="metrics.nested"):
        store.commit("sft", tmp_path / "src", config={}, metrics={"nested": {"a": 1}})
    assert store.versions("sft") == [1]


def test_aliases(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    for tag in "abc":
        store.commit("rl", make_source(tmp_path / tag, tag), config={"tag": tag})

    assert store.aliases("rl") == {"latest": 3}
    store.set_alias("rl", "production", 2)
    assert store.get("rl", "production").version == 2
    assert store.alias_record("rl", "production")["previous"] is None
    store.set_alias("rl", "production", 1)  # moving an alias records a new move
    assert store.get("rl", "production").version == 1
    # The pointer remembers what it replaced (the gate compares with it), also when set to the same version again.
    assert store.alias_record("rl", "production")["previous"] == 2
    store.set_alias("rl", "production", 1)
    assert store.alias_record("rl", "production")["previous"] == 2 and store.alias_record("rl", "staging") is None
    store.set_alias("rl", "latest", 2)  # an explicit latest overrides the derived one
    assert store.get("rl").version == 2
    assert store.aliases("rl") == {"latest": 2, "production": 1}
    with pytest.raises(ArtifactError, match="not a committed version"):
        store.set_alias("rl", "production", 9)
    with pytest.raises(ArtifactError, match="reads as a version"):
        store.set_alias("rl", "v2", 2)


def test_lineage_and_listing(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    sft = store.commit("sft", make_source(tmp_path / "sft", "sft"), config={})
    rm = store.commit("reward_model", make_source(tmp_path / "rm", "rm"), config={},
                      inputs={"base": sft.input_ref()})
    rl = store.commit("rl", make_source(tmp_path / "rl", "rl"), config={},
                      inputs={"actor": sft.input_ref(), "reward": rm.input_ref()})
    store.set_alias("rl", "production", rl.version)

    assert [m.uri for m in store.lineage("rl")] == [rl.uri, sft.uri, rm.uri]  # sft appears once

    table = store.listing().splitlines()
    assert table[0].split() == ["stage", "version", "aliases", "created", "digest", "inputs"]
    rl_row = next(line for line in table if line.startswith("rl "))
    assert "latest,production" in rl_row and rl.digest[:12] in rl_row
    assert "actor=sft/v0001, reward=reward_model/v0001" in rl_row
    assert len(table) == 4


def test_lineage_detects_a_replaced_input(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    sft = store.commit("sft", make_source(tmp_path / "sft", "sft"), config={})
    forged = sft.input_ref().model_copy(update={"digest": "0" * 64})
    store.commit("reward_model", make_source(tmp_path / "rm", "rm"), config={}, inputs={"base": forged})
    with pytest.raises(ArtifactError, match="input 'base'"):
        store.lineage("reward_model")


def test_corrupted_file_is_named(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    manifest = store.commit("sft", make_source(tmp_path / "src", "a"), config={})
    stored = f"{store.fs._strip_protocol(manifest.uri)}/weights-1.bin"
    data = bytearray(store.fs.cat_file(stored))
    data[10] ^= 0xFF  # same size, one byte flipped
    replace_stored(store.fs, stored, bytes(data))

    with pytest.raises(ChecksumError, match=r"v0001/weights-1\.bin"):
        store.verify(manifest)
    with pytest.raises(ChecksumError, match=r"weights-1\.bin"):
        store.download(manifest, tmp_path / "dl")
    store.download(manifest, tmp_path / "unchecked", verify=False)

    store.fs.rm(stored)
    with pytest.raises(ChecksumError, match=r"weights-1\.bin: missing"):
        store.verify(manifest)



def test_a_damaged_version_is_found_before_reuse_and_quarantined(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    manifest = store.commit("sft", make_source(tmp_path / "src", "a"), config={}, stage_key="key-a")
    store.verify_for_reuse(manifest)
    stored = f"{store.fs._strip_protocol(manifest.uri)}/weights-1.bin"
    data = bytearray(store.fs.cat_file(stored))
    data[10] ^= 0xFF  # same size: the local store's full check, S3's ETag recorded at commit
    replace_stored(store.fs, stored, bytes(data))
    with pytest.raises(ChecksumError, match=r"v0001/weights-1\.bin" + ("" if store.is_local else
                                                                       ": the stored object was rewritten since")):
        store.verify_for_reuse(manifest)
    assert bool(manifest.etags) != store.is_local
    replace_stored(store.fs, stored, bytes(data[:-1]))  # cut short
    with pytest.raises(ChecksumError, match=r"v0001/weights-1\.bin" + ("" if store.is_local else r": 991 bytes, the "
                                                                        r"manifest recorded 992")):
        store.verify_for_reuse(manifest)

    store.quarantine("sft", 1, "weights-1.bin cut short")
    store.quarantine("sft", 1, "found again by a concurrent run")  # the first record stays
    assert store.quarantined("sft") == {1: "weights-1.bin cut short"}
    assert store.find_by_stage_key("sft", "key-a") is None and store.get("sft", 1) == manifest
    assert "QUARANTINED" in store.listing() and "weights-1.bin cut short" in store.listing()
    rebuilt = store.commit("sft", make_source(tmp_path / "src2", "a"), config={}, stage_key="key-a")
    assert store.find_by_stage_key("sft", "key-a") == rebuilt


def test_a_torn_alias_record_is_skipped_and_the_next_move_takes_the_number_after_it(store_root, tmp_path,
                                                                                      monkeypatch):
    """production's newest move record cut to 0 bytes (its mover crashed between creating and writing it, long
    ago): reads, listings and promotions go on from the move before, saying so; the next move is number 4, after
    the torn 3."""
    monkeypatch.setattr(artifacts, "MOVE_IN_PROGRESS_S", 0.0)
    warnings: list[str] = []
    store = open_store(store_root, "pipe", log=warnings.append)
    for name in "abc":
        store.commit("sft", make_source(tmp_path / name, name), config={})
    store.set_alias("sft", "production", 1)
    store.set_alias("sft", "production", 2, expected=1)
    store.fs.pipe_file(f"{store.base}/sft/aliases/production/000003.json", b"")  # a torn move to v3
    assert store.get("sft", "production").version == 2 and store.aliases("sft")["production"] == 2
    assert any("skipping torn alias record" in w and "000003.json" in w for w in warnings), warnings
    assert "production" in store.listing()
    store.set_alias("sft", "production", 3, expected=2)
    record = store.alias_record("sft", "production")
    assert (record["version"], record["previous"], record["move"]) == (3, 2, 4)


def test_an_alias_move_record_still_being_written_is_waited_for_not_skipped(store_root, tmp_path):
    """A mover between creating its record and writing it (as movers did before records were created whole): a
    compare-and-swap from the version before must wait for the record and refuse, not read past it and also win."""
    store = open_store(store_root, "pipe")
    for name in "abc":
        store.commit("sft", make_source(tmp_path / name, name), config={})
    store.set_alias("sft", "production", 1)
    path = f"{store.base}/sft/aliases/production/000002.json"
    store.fs.pipe_file(path, b"")
    record = {"alias": "production", "version": 2, "previous": 1, "move": 2, "updated_at": "2026-12-07T00:00:00"}
    writer = threading.Timer(1.5, lambda: store.fs.pipe_file(path, json.dumps(record).encode()))
    writer.start()
    with pytest.raises(AliasMoved, match="not v0001 as expected") as moved:
        store.set_alias("sft", "production", 3, expected=1)
    writer.join()
    assert moved.value.current == 2 and store.get("sft", "production").version == 2
    # Written whole: no move record is ever seen empty, and no temporary file stays behind.
    store.set_alias("sft", "production", 3, expected=2)
    assert sorted(p.rsplit("/", 1)[1] for p in store.fs.ls(path.rsplit("/", 1)[0], detail=False)) == [
        "000001.json", "000002.json", "000003.json"]


def test_versions_are_never_overwritten(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    source_a = make_source(tmp_path / "a", "a")
    first = store.commit("sft", source_a, config={})
    store.commit("sft", make_source(tmp_path / "b", "b"), config={})
    assert tree_bytes(store.download(store.get("sft", 1), tmp_path / "dl1")) == tree_bytes(source_a)
    assert store.get("sft", 1) == first

    # The claim is an exclusive create on both backends (O_EXCL / If-None-Match: *).
    stage = store.fs._strip_protocol(first.uri).rsplit("/", 1)[0]
    with pytest.raises(FileExistsError):
        with store.fs.open(f"{stage}/_claims/v0001.json", "xb") as f:
            f.write(b"{}")

    # A writer that died after claiming v0003: the half-written version stays invisible and is skipped.
    store.fs.pipe_file(f"{stage}/_claims/v0003.json", b"{}")
    store.fs.pipe_file(f"{stage}/v0003/weights-0.bin", b"partial")
    assert store.versions("sft") == [1, 2]
    with pytest.raises(ArtifactError, match="not a committed version"):
        store.get("sft", 3)
    assert store.commit("sft", make_source(tmp_path / "c", "c"), config={}).version == 4
    assert store.fs.cat_file(f"{stage}/v0003/weights-0.bin") == b"partial"
    assert store.versions("sft") == [1, 2, 4] and store.get("sft").version == 4

    # Even with the claim records gone, version folders are never written into again.
    store.fs.rm(f"{stage}/_claims", recursive=True)
    assert store.commit("sft", make_source(tmp_path / "d", "d"), config={}).version == 5
    assert tree_bytes(store.download(store.get("sft", 1), tmp_path / "dl1-again")) == tree_bytes(source_a)


def test_concurrent_writers_get_distinct_versions(store_root, tmp_path):
    tags = [f"w{i}" for i in range(4)]
    go_file = tmp_path / "go"
    writers = {}
    for tag in tags:
        source = make_source(tmp_path / tag, tag, n_files=4, size=64 * 1024)
        writers[tag] = (*start_writer(store_root, "sft", source, tag, tmp_path, str(go_file)), source)
    for proc, log, _ in writers.values():
        wait_for_line(log, "ready", proc)
    go_file.touch()  # release all writers at once
    for proc, log, _ in writers.values():
        assert proc.wait(timeout=180) == 0, log.read_text()

    store = open_store(store_root, "pipe")
    assert store.versions("sft") == [1, 2, 3, 4]
    by_writer = {store.get("sft", v).config["writer"]: v for v in store.versions("sft")}
    assert sorted(by_writer) == tags
    for tag, version in by_writer.items():
        manifest = store.get("sft", version)
        store.verify(manifest)
        assert tree_bytes(store.download(manifest, tmp_path / f"dl-{tag}")) == tree_bytes(writers[tag][2])


@pytest.mark.parametrize(("pause_at", "next_version"), [("upload:2", 2), ("move:2", 3)],
                         ids=["mid-upload", "after-claim"])
def test_killed_writer_leaves_no_version(store_root, tmp_path, pause_at, next_version):
    store = open_store(store_root, "pipe")
    store.commit("sft", make_source(tmp_path / "first", "first"), config={})
    big = make_source(tmp_path / "big", "big", n_files=6, size=512 * 1024)
    proc, log = start_writer(store_root, "sft", big, "killed", tmp_path, pause_at=pause_at)
    try:
        wait_for_line(log, f"paused at {pause_at}", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    assert store.versions("sft") == [1]
    assert store.get("sft").version == 1
    retry = store.commit("sft", big, config={})
    assert retry.version == next_version  # a claimed number is never reused
    assert store.versions("sft") == [1, next_version]
    store.verify(retry)


def test_plain_path_and_file_uri_are_the_same_store(tmp_path):
    source = make_source(tmp_path / "src", "a")
    ArtifactStore(str(tmp_path / "root"), "pipe").commit("sft", source, config={})
    via_uri = ArtifactStore((tmp_path / "root").as_uri(), "pipe")
    assert via_uri.versions("sft") == [1]
    assert via_uri.get("sft").uri == f"{(tmp_path / 'root').as_uri()}/pipe/sft/v0001"


def test_gc_removes_what_killed_writers_left_after_the_grace_period(store_root, tmp_path):
    """A writer killed after its claim leaves a staging entry and a version folder without manifest: the gc
    command keeps them while they are young (a live writer's), removes them once old; versions are untouched."""
    store = open_store(store_root, "pipe")
    store.commit("sft", make_source(tmp_path / "first", "first"), config={})
    proc, log = start_writer(store_root, "sft", make_source(tmp_path / "big", "big"), "killed", tmp_path,
                             pause_at="move:2")
    try:
        wait_for_line(log, "paused at move:2", proc)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = store.garbage("sft", grace_s=0)
    assert any("/_staging/" in path for path in leftovers) and any(path.endswith("/v0002") for path in leftovers)

    def gc(grace_s: float, minimum: str = "0", returncode: int = 0) -> str:
        done = subprocess.run([sys.executable, "-m", "infra.artifacts", "gc", store_root, "--grace-s", str(grace_s)],
                              cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "RLHF_MIN_STAGING_GRACE_S": minimum})  # fmt: skip
        assert done.returncode == returncode, done.stderr
        return done.stdout + done.stderr

    assert gc(3600) == "" and store.garbage("sft", grace_s=0) == leftovers
    # A grace below the minimum could take a live upload for a leftover: refused, nothing removed.
    assert "below the minimum of 3600s" in gc(0, minimum="3600", returncode=2)
    assert store.garbage("sft", grace_s=0) == leftovers
    assert sorted(line.removeprefix("removed ") for line in gc(0).splitlines()) == sorted(
        store._uri(path) for path in leftovers)  # fmt: skip
    assert store.garbage("sft", grace_s=0) == []
    assert store.versions("sft") == [1]
    store.verify(store.get("sft", 1))


def test_commit_cleans_leftovers_older_than_the_grace_period(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    leftover = f"{store._stage_path('sft')}/_staging/{'0' * 32}/weights.bin"
    store.fs.pipe_file(leftover, b"half an upload")
    store.commit("sft", make_source(tmp_path / "a", "a"), config={})
    assert store.garbage("sft", grace_s=0) != []  # younger than the default grace: kept

    messages = []
    impatient = ArtifactStore(store_root, "pipe", store.storage_options, staging_grace_s=0, min_grace_s=0,
                              log=messages.append)
    impatient.commit("sft", make_source(tmp_path / "b", "b"), config={})
    assert impatient.garbage("sft", grace_s=0) == []
    assert any("removed" in message and "_staging" in message for message in messages), messages
    assert impatient.versions("sft") == [1, 2]


def test_a_writer_paused_past_the_grace_period_commits_nothing(store_root, tmp_path):
    """The writer stops with its files in the version folder it claimed, before the manifest; meanwhile another
    writer's commit takes that folder (no manifest, nothing changed for longer than the grace) for a dead writer's
    and removes it. The paused writer, back, must not write a manifest standing for files that are gone."""
    paused = ArtifactStore(store_root, "pipe", staging_grace_s=2, min_grace_s=0, log=lambda message: None)
    other = ArtifactStore(store_root, "pipe", paused.storage_options, staging_grace_s=2, min_grace_s=0,
                          log=lambda message: None)
    source = make_source(tmp_path / "paused", "paused")
    move, moved = paused._move, []

    def move_then_pause(src: str, dst: str) -> None:
        move(src, dst)
        moved.append(dst)
        if len(moved) == len(tree_bytes(source)):  # every file in v0001, its manifest not yet written
            time.sleep(3.5)  # past the grace (S3 times have a resolution of a second)
            other.commit("sft", make_source(tmp_path / "other", "other"), config={})

    paused._move = move_then_pause
    with pytest.raises(ArtifactError, match=r"v0001: 5 of its files are gone before its manifest is written"):
        paused.commit("sft", source, config={})
    assert other.versions("sft") == [2]  # v0001 was collected and never got a manifest
    other.verify(other.get("sft", 2))


def test_a_local_commit_is_flushed_to_disk_and_read_only(tmp_path, monkeypatch):
    """Every file's data, then the folders the files were moved into, then the manifest and its folder reach the
    disk before commit returns; the committed files cannot be opened for writing."""
    store = open_store(str(tmp_path / "artifacts"), "pipe")
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd)))
    manifest = store.commit("sft", make_source(tmp_path / "src", "a"), config={})
    version = Path(store._version_path("sft", 1))
    stage = version.parent
    # The claim's data under a temporary name, then its folder once the name is linked to it.
    assert synced[5].startswith(str(stage / "_claims" / ".v0001.json.")) and synced[6] == str(stage / "_claims")
    staged, (*moved, manifest_tmp, manifest_folder) = synced[:5], synced[7:]
    assert sorted(path.split("/_staging/")[1].split("/", 1)[1] for path in staged) == sorted(manifest.files)
    assert moved == [str(version / "tokenizer"), str(version)]  # deepest first, before the manifest
    assert manifest_tmp.startswith(str(stage / "_staging")) and manifest_folder == str(version)
    for rel in [*manifest.files, MANIFEST_NAME]:
        assert (version / rel).stat().st_mode & 0o777 == 0o444, rel
    store.verify(manifest)
    assert store.download(manifest, tmp_path / "copy").joinpath("weights-0.bin").stat().st_mode & 0o200  # a copy is
    # the reader's own, writable


# ---------------------------------------------------------------------------------------------- what reading checks

def stored_path(store, manifest, rel: str = "") -> str:
    path = store.fs._strip_protocol(manifest.uri)
    return f"{path}/{rel}" if rel else path


def rewrite_manifest(store, manifest, **changes) -> None:
    """Replace a stored manifest by one with `changes` (its digest kept consistent with its files table)."""
    data = {**json.loads(store.fs.cat_file(stored_path(store, manifest, MANIFEST_NAME))), **changes}
    if "files" in changes:
        table = {rel: [e["size"], e["sha256"]] for rel, e in sorted(changes["files"].items())}
        data["digest"] = hashlib.sha256(json.dumps(table, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    replace_stored(store.fs, stored_path(store, manifest, MANIFEST_NAME), json.dumps(data).encode())


def test_non_finite_metrics_are_refused_at_commit_naming_them(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    source = make_source(tmp_path / "src", "a")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ArtifactError, match=r"non-finite metric accuracy \((nan|inf)\)"):
            store.commit("evaluate", source, config={}, metrics={"accuracy": bad, "prompts": 16})
    (source / "metrics.json").write_text('{"accuracy": NaN}')  # what json.dumps writes for a NaN
    with pytest.raises(ArtifactError, match="non-finite metric accuracy"):
        store.commit("evaluate", source, config={})
    # A serializer's own key would make the task result that carries the metrics unloadable.
    with pytest.raises(ArtifactError, match=r"metric names '__exc_type__': a name may not start with __"):
        store.commit("evaluate", source, config={}, metrics={"__exc_type__": "builtins.ValueError", "prompts": 1})
    (source / "metrics.json").write_text('{"prompts": 1, "pad": "' + "x" * (17 * 2**20) + '"}')
    with pytest.raises(ArtifactError, match=r"metrics.json: \d+ bytes, over the 16777216 a stage's metrics may hold"):
        store.commit("evaluate", source, config={})
    assert store.versions("evaluate") == []
    (source / "metrics.json").unlink()
    committed = store.commit("evaluate", source, config={})
    with pytest.raises(ArtifactError, match=r"weights-0.bin holds \d+ bytes, over the 4 read of it: not read"):
        store.read_file(committed, "weights-0.bin", max_bytes=4)


def test_an_unreadable_manifest_is_skipped_and_reported_never_fatal(store_root, tmp_path):
    """A manifest written before non-finite metrics were refused (`null`), newest of its stage: reuse still finds the
    older version, the listing and `verify` report it and go on."""
    messages = []
    store = ArtifactStore(store_root, "pipe", log=messages.append)
    good = store.commit("evaluate", make_source(tmp_path / "a", "a"), config={}, stage_key="night-1")
    broken = store.commit("evaluate", make_source(tmp_path / "b", "b"), config={}, stage_key="night-2")
    rewrite_manifest(store, broken, metrics={"accuracy": None})

    assert store.find_by_stage_key("evaluate", "night-1") == good
    assert store.find_by_stage_key("evaluate", "night-2") is None
    assert any("skipping unreadable evaluate v0002" in m and "metrics.accuracy" in m for m in messages), messages
    assert [m.version for m in store.readable("evaluate")] == [1]
    row = next(line for line in store.listing().splitlines() if line.startswith("evaluate") and "v0002" in line)
    assert "UNREADABLE" in row

    done = subprocess.run([sys.executable, "-m", "infra.artifacts", "verify", store_root, "pipe"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done.stderr  # a finding, not a crash
    assert f"ok      {good.uri}" in done.stdout and "UNREADABLE  evaluate v0002" in done.stdout


@pytest.mark.parametrize("name", ["../../../escape.bin", "/etc/passwd", "a\\..\\b.bin", "./weights-0.bin", "a//b"])
def test_manifest_file_names_outside_the_version_are_refused(store_root, tmp_path, name):
    store = open_store(store_root, "pipe")
    manifest = store.commit("sft", make_source(tmp_path / "src", "a"), config={})
    entry = manifest.files["weights-0.bin"].model_dump()
    rewrite_manifest(store, manifest, files={name: entry})
    with pytest.raises(ArtifactError, match="is not a relative path inside the version folder"):
        store.get("sft", 1)
    forged = manifest.model_copy(update={"files": {name: manifest.files["weights-0.bin"]}})
    with pytest.raises(ArtifactError):  # a manifest built by hand is refused too, before anything is written
        store.download(forged, tmp_path / "dl")
    assert not (tmp_path / "escape.bin").exists()


def test_commit_refuses_symlinks(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    secret = tmp_path / "outside.txt"
    secret.write_text("not part of the model")
    source = make_source(tmp_path / "src", "a")
    (source / "linked.txt").symlink_to(secret)
    with pytest.raises(ArtifactError, match=r"symlinks are refused \(linked.txt\)"):
        store.commit("sft", source, config={})
    (source / "linked.txt").unlink()
    (source / "linked_dir").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(ArtifactError, match="linked_dir"):
        store.commit("sft", source, config={})
    assert store.versions("sft") == []


def test_verify_refuses_unlisted_files_and_symlinks_in_a_version(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    manifest = store.commit("sft", make_source(tmp_path / "src", "a"), config={})
    store.fs.pipe_file(stored_path(store, manifest, "modeling_extra.py"), b"import os")
    with pytest.raises(ChecksumError, match="files the manifest does not list: modeling_extra.py"):
        store.verify(manifest)
    store.fs.rm(stored_path(store, manifest, "modeling_extra.py"))
    store.verify(manifest)
    if store_root.startswith("s3://"):
        return  # S3 has no symlinks
    weights = Path(stored_path(store, manifest, "weights-0.bin"))
    copy = tmp_path / "elsewhere.bin"
    copy.write_bytes(weights.read_bytes())  # same bytes, but the version no longer holds them
    weights.unlink()
    weights.symlink_to(copy)
    with pytest.raises(ChecksumError, match="symlinks in the version folder: weights-0.bin"):
        store.verify(manifest)


def copy_tree(store, src: str, dst: str) -> None:
    for path in store.fs.find(src):
        store.fs.pipe_file(dst + path[len(src):], store.fs.cat_file(path))


def test_a_manifest_is_where_it_was_read_or_refused(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    sft = store.commit("sft", make_source(tmp_path / "sft", "sft"), config={})
    rl = store.commit("rl", make_source(tmp_path / "rl", "rl"), config={}, inputs={"pretrain": sft.input_ref()})
    base = store.fs._strip_protocol(sft.uri).rsplit("/", 3)[0]

    # The whole store copied to another root (staging -> production bucket): everything read from the copy.
    copy_tree(store, base, base + "-copy")
    copy = open_store(store._uri(base + "-copy"), "pipe")
    moved = copy.get("rl", 1)
    assert moved.uri == store._uri(base + "-copy/pipe/rl/v0001") and moved.digest == rl.digest
    assert [m.uri for m in copy.lineage("rl")] == [moved.uri, copy.get("sft", 1).uri]
    copy.verify(moved)

    # A version folder copied to another version number, stage or pipeline: its manifest says otherwise.
    for target, claims in ((f"{base}/pipe/sft/v0007", "pipe/sft v0001"), (f"{base}/pipe/rl/v0002", "pipe/sft v0001"),
                           (f"{base}/other/sft/v0001", "pipe/sft v0001")):  # fmt: skip
        copy_tree(store, f"{base}/pipe/sft/v0001", target)
        _, pipeline, stage, version = target.rsplit("/", 3)
        with pytest.raises(ArtifactError, match=f"describes {claims}, not the folder it was read from"):
            open_store(store_root, pipeline).get(stage, int(version[1:]))


def test_alias_moves_are_compare_and_swap(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    for tag in "abc":
        store.commit("rl", make_source(tmp_path / tag, tag), config={})
    store.set_alias("rl", "production", 1, expected=None)
    with pytest.raises(AliasMoved, match="points at v0001, not nothing") as moved:
        store.set_alias("rl", "production", 2, expected=None)  # a promotion that compared with "no production"
    assert moved.value.current == 1 and store.get("rl", "production").version == 1
    store.set_alias("rl", "production", 2, expected=1)
    assert store.alias_record("rl", "production")["previous"] == 1


ALIAS_MOVER = """
import os, sys, time
from infra.artifacts import AliasMoved, open_store
root, version, go_file = sys.argv[1:]
store = open_store(root, "pipe")
store.alias_record("rl", "production")  # connected
print("ready", flush=True)
while not os.path.exists(go_file):
    time.sleep(0.002)
try:
    store.set_alias("rl", "production", int(version), expected=None)
    print("moved", flush=True)
except AliasMoved as error:
    print("refused", error.current, flush=True)
"""


def test_of_two_concurrent_alias_moves_from_the_same_version_one_wins(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    for tag in "ab":
        store.commit("rl", make_source(tmp_path / tag, tag), config={})
    go_file = tmp_path / "go"
    movers = {version: subprocess.Popen([sys.executable, "-c", ALIAS_MOVER, store_root, str(version), str(go_file)],
                                        cwd=REPO, stdout=subprocess.PIPE, text=True) for version in (1, 2)}
    assert all(proc.stdout.readline() == "ready\n" for proc in movers.values())
    go_file.touch()  # both read "no production" and race for the first move
    outcomes = {version: proc.communicate(timeout=120)[0].split() for version, proc in movers.items()}
    (winner,) = [version for version, words in outcomes.items() if words == ["moved"]]
    (loser,) = set(outcomes) - {winner}
    assert outcomes[loser] == ["refused", str(winner)]
    assert store.get("rl", "production").version == winner


class ListsThenWaits(ArtifactStore):
    """A gc whose listing is followed by `meanwhile()` before it removes anything, as when a writer resumes."""

    listed: list[str] = []
    meanwhile = staticmethod(lambda: None)

    def garbage(self, stage, grace_s):
        self.listed = super().garbage(stage, grace_s)
        self.meanwhile()
        return self.listed


def test_gc_looks_at_each_leftover_again_before_removing_it(store_root, tmp_path):
    store = open_store(store_root, "pipe")
    store.commit("sft", make_source(tmp_path / "first", "first"), config={})
    stage = store._stage_path("sft")
    staging = f"{stage}/_staging/{'1' * 32}"
    store.fs.pipe_file(f"{stage}/v0002/weights-0.bin", b"claimed, manifest not yet written")
    store.fs.pipe_file(f"{staging}/weights-0.bin", b"an upload")
    time.sleep(3.5)  # both older than the grace below (S3 times have a resolution of a second)

    def writer_comes_back():  # the version gets its manifest, the upload a new file
        copy_tree(store, f"{stage}/v0001/{MANIFEST_NAME}", f"{stage}/v0002/{MANIFEST_NAME}")
        store.fs.pipe_file(f"{staging}/weights-1.bin", b"more of the upload")

    gc = ListsThenWaits(store_root, "pipe", staging_grace_s=3, min_grace_s=0, log=lambda message: None)
    gc.meanwhile = writer_comes_back
    assert gc.collect_garbage("sft", grace_s=3) == []
    assert len(gc.listed) == 2  # both were leftovers when listed
    assert store.fs.exists(f"{stage}/v0002/weights-0.bin") and store.fs.exists(f"{staging}/weights-0.bin")
