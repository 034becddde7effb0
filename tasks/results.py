"""Where Prefect persists the flow's task results, and the check every result passes before Prefect loads it.

A retried flow run loads the results of the tasks that finished (what makes it skip them). A result file names its
own serializer, and Prefect deserializes it with that one: a file planted where results live could name pickle and
run code on the worker, which holds the S3, Ray and Prefect credentials. So results are written as JSON
(RESULT_SERIALIZER), kept out of every folder stage jobs write (not under the workspace root), and read through a
checked storage block (`CheckedReads`), which refuses a result whose serializer is anything but that JSON, or that
names a class outside this project's packages (an exception type outside them, Python's and Prefect's).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.serializers import JSONSerializer, prefect_json_object_decoder, prefect_json_object_encoder
from prefect.utilities.importtools import from_qualified_name, to_qualified_name
from pydantic import BaseModel
from prefect.settings import PREFECT_HOME

from infra.settings import Settings

# JSON with Prefect's encoding but for pydantic models, written {"__class__", "fields"}: a flow's result is stored bare
# (its metadata lives in the run's state) and Prefect reads a bare JSON object with a "data" key, its own encoding
# of a model, as an old-format result record: the result came back as a dict in any other process.
RESULT_SERIALIZER = JSONSerializer(object_encoder="tasks.results.encode_result_object",
                                   object_decoder="tasks.results.decode_result_object")
# Classes a result may name (Prefect's JSON encoder records each pydantic model's class): this project's only.
RESULT_PACKAGES = ("flows.", "pipeline.", "tasks.", "stages.", "infra.")
# Exception types a failed task's result may name (Prefect records `__exc_type__` and imports its module to rebuild
# it): this project's, Python's own and Prefect's.
EXCEPTION_PACKAGES = (*RESULT_PACKAGES, "builtins.", "prefect.exceptions.")
# The keys under which Prefect's JSON decoder imports a module by the name it finds (serializers.py
# prefect_json_object_decoder), and the packages each may name.
IMPORTING_KEYS = {"__class__": RESULT_PACKAGES, "__exc_type__": EXCEPTION_PACKAGES}


def encode_result_object(obj: Any) -> Any:
    """`json.dumps(default=...)` of results: a pydantic model as its class and fields, else Prefect's encoding."""
    if isinstance(obj, BaseModel):
        return {"__class__": to_qualified_name(type(obj)), "fields": obj.model_dump(mode="json")}
    return prefect_json_object_encoder(obj)


def decode_result_object(value: dict[str, Any]) -> Any:
    """`json.loads(object_hook=...)` of results: the inverse of encode_result_object (classes were checked first)."""
    if "__class__" in value and "fields" in value:
        return from_qualified_name(value["__class__"]).model_validate(value["fields"])
    return prefect_json_object_decoder(value)


class RefusedResult(ValueError):
    """A persisted result that this project did not write the way it writes them."""


def _foreign_names(value: Any) -> list[str]:
    """Every class or exception type that a decoded JSON result names, at any depth, outside the packages its key
    may name (a name that is not a string counts too)."""
    if isinstance(value, dict):
        named = []
        for key, allowed in IMPORTING_KEYS.items():
            name = value.get(key)
            if key in value and not (isinstance(name, str) and name.startswith(allowed)):
                named.append(name if isinstance(name, str) else repr(name))
        return named + [name for item in value.values() for name in _foreign_names(item)]
    if isinstance(value, list):
        return [name for item in value for name in _foreign_names(item)]
    return []


def check_result_record(content: bytes, path: str) -> None:
    """Raise RefusedResult unless `content` is JSON this project wrote: a result record (a task's, naming its own
    serializer: this project's JSON settings only), or a bare JSON result (a flow's, whose serializer its run's
    state on the server names); either way every class it names belongs to this project."""
    try:
        decoded = json.loads(content)
    except ValueError as error:
        raise RefusedResult(f"result {path}: not JSON ({error}); only JSON results are read (was it planted there?)"
                            ) from None
    if isinstance(decoded, dict) and "metadata" in decoded and "result" in decoded:
        serializer = decoded["metadata"].get("serializer") if isinstance(decoded["metadata"], dict) else None
        if serializer != RESULT_SERIALIZER.model_dump(mode="json"):
            kind = serializer.get("type") if isinstance(serializer, dict) else serializer
            raise RefusedResult(f"result {path}: written with serializer {kind!r} or settings this project never "
                                "uses; only JSON results are read (was it planted there?)")
        try:
            decoded = json.loads(decoded["result"])
        except (TypeError, ValueError) as error:
            raise RefusedResult(f"result {path}: its result is not JSON ({error})") from None
    foreign = _foreign_names(decoded)
    if foreign:
        raise RefusedResult(f"result {path}: names classes outside this project ({', '.join(sorted(set(foreign)))})")


class CheckedReads:
    """Result storage that checks every result before Prefect loads it (mixed into a Prefect filesystem block)."""

    async def aread_path(self, path: str) -> bytes:
        content = await super().aread_path(path)
        check_result_record(content, path)
        return content

    def read_path(self, path: str, _sync: bool | None = None):
        # Prefect's result store calls read_path(..., _sync=True) (its filesystems dispatch sync/async on it); an
        # override without the argument raised there, and Prefect took every result for missing: no retry ever
        # came back Cached.
        if _sync is False:
            return self.aread_path(path)
        content = super().read_path(path, _sync=True)
        check_result_record(content, path)
        return content


class JsonLocalResults(CheckedReads, LocalFileSystem):
    """Checked results in a local (or shared) folder."""

    _block_type_name = "RLHF JSON Local Results"


class JsonRemoteResults(CheckedReads, RemoteFileSystem):
    """Checked results under an fsspec URL (s3://bucket/prefix); credentials from each worker's environment."""

    _block_type_name = "RLHF JSON Remote Results"


def result_location(settings: Settings) -> str:
    """RLHF_RESULT_STORAGE (a local folder or an fsspec URL); unset: <PREFECT_HOME>/rlhf-results, which no stage
    job writes."""
    value = (settings.result_storage or str(PREFECT_HOME.value() / "rlhf-results")).removeprefix("file://")
    return value if "://" in value else str(Path(value).expanduser().resolve())


def result_storage(settings: Settings) -> str:
    """The saved checked-results block for the settings' result location, as the slug Prefect's tasks take (block
    instances must be saved)."""
    location = result_location(settings)
    name = "rlhf-results-" + hashlib.sha256(location.encode()).hexdigest()[:12]
    block = JsonRemoteResults(basepath=location) if "://" in location else JsonLocalResults(basepath=location)
    block.save(name, overwrite=True)
    return f"{type(block).get_block_type_slug()}/{name}"


def persisted(settings: Settings) -> dict[str, Any]:
    """Task options that persist a task's result as checked JSON in the result storage."""
    return {"result_storage": result_storage(settings), "result_serializer": RESULT_SERIALIZER}
