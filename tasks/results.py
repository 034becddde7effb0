"""Where Prefect persists the flow's task results, and the check every result passes before Prefect loads it.

A retried flow run loads the results of the tasks that finished (what makes it skip them). A result file names its
own serializer, and Prefect deserializes it with that one: a file planted where results live could name pickle and
run code on the worker, which holds the S3, Ray and Prefect credentials. So results are written as JSON with
Prefect's default JSON settings, kept out of every folder stage jobs write (not under the workspace root), and read
through a checked storage block (`CheckedReads`), which refuses a result whose serializer is anything but that JSON, or that names a
class outside this project's packages.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.serializers import JSONSerializer
from prefect.settings import PREFECT_HOME

from infra.settings import Settings

RESULT_SERIALIZER = "json"
# Classes a result may name (Prefect's JSON encoder records each pydantic model's class): this project's only.
RESULT_PACKAGES = ("flows.", "pipeline.", "tasks.", "stages.", "infra.")


class RefusedResult(ValueError):
    """A persisted result that this project did not write the way it writes them."""


def _classes(value: Any) -> list[str]:
    """Every `__class__` that a decoded JSON result names, at any depth."""
    if isinstance(value, dict):
        named = [value["__class__"]] if isinstance(value.get("__class__"), str) else []
        return named + [name for item in value.values() for name in _classes(item)]
    if isinstance(value, list):
        return [name for item in value for name in _classes(item)]
    return []


def check_result_record(content: bytes, path: str) -> None:
    """Raise RefusedResult unless `content` is a result record serialized with Prefect's default JSON settings whose
    classes all belong to this project."""
    try:
        record = json.loads(content)
        serializer = record["metadata"]["serializer"]
        result = record["result"]
    except (ValueError, KeyError, TypeError) as error:
        raise RefusedResult(f"result {path}: not a result record ({error})") from None
    if serializer != JSONSerializer().model_dump(mode="json"):
        kind = serializer.get("type") if isinstance(serializer, dict) else serializer
        raise RefusedResult(f"result {path}: written with serializer {kind!r} or settings this project never uses; "
                            "only JSON results are read (was it planted there?)")
    foreign = [name for name in _classes(json.loads(result)) if not name.startswith(RESULT_PACKAGES)]
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
