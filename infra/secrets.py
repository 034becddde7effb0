"""Keep secret values out of what the orchestration writes: Prefect logs, state messages, manifests, UI artifacts.

A variable is secret when its name says so (`*_TOKEN`, `*_SECRET*`, `*_KEY`, `AWS_*`, `RAY_AUTH_TOKEN`). Redaction
replaces each such variable's value wherever it appears in a text, so a job that prints its credentials (or a
library that puts them in an error message) leaves `[redacted AWS_SECRET_ACCESS_KEY]` in the Prefect database.
Values shorter than MIN_SECRET_LENGTH are left alone: `AWS_MAX_ATTEMPTS=3` is no secret, and replacing every
"3" would make the logs unreadable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

SECRET_NAME = re.compile(r"^(AWS_.*|RAY_AUTH_TOKEN|.*_TOKEN|.*_SECRET.*|.*_KEY)$")
MIN_SECRET_LENGTH = 8


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.match(name.upper()))


class Redactor:
    """Replaces the values of the secret variables of an environment (default: this process's) in texts."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        secrets = {value: name for name, value in environ.items()
                   if is_secret_name(name) and len(value) >= MIN_SECRET_LENGTH}
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = sorted(secrets.items(), key=lambda item: -len(item[0]))

    def text(self, text: str) -> str:
        for value, name in self._secrets:
            if value in text:
                text = text.replace(value, f"[redacted {name}]")
        return text

    def data(self, value: Any) -> Any:
        """The same structure (dicts, lists, strings, numbers) with secrets replaced in every string."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.data(v) for v in value)
        return value
