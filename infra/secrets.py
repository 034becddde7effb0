"""Keep secrets out of what the orchestration and the stages write: Prefect logs, state messages, manifests, UI
artifacts, job logs, tracker configs.

Two kinds of redaction, both applied by `Redactor.text`:
- by value: a variable is secret when its name says so (`TOKEN`, `*_TOKEN*`, `*SECRET*`, `*_KEY(S)`, `*_KEY_*`,
  `*APIKEY*`, `*PASSWORD*`, `*PASSWD*`, `*_PASS`, `*PASSPHRASE*`, `*CREDENTIAL*`, `*CONNECTION_STRING*`, `*_DSN`,
  `*JWT*`, `AWS_*`, `RAY_AUTH_TOKEN`, `*AUTH_STRING` (Prefect's client and server basic auth), `*DATABASE_URL`,
  `*_CONNECTION_URL`), or when its value is a URL that carries credentials (`REDIS_URL=redis://:pw@h`);
  each such variable's value is replaced wherever it appears, so a job that prints its credentials leaves
  `[redacted AWS_SECRET_ACCESS_KEY]`.
  Values shorter than MIN_SECRET_LENGTH are left alone: `AWS_MAX_ATTEMPTS=3` is no secret, and replacing every "3"
  would make the logs unreadable.
- by pattern, for secrets no variable of this process holds (a token inside a config value, a credential only the
  Ray nodes have): the userinfo of URLs (`https://user:pass@host`), credential query, fragment and matrix parameters
  (any name holding token, key, secret, pass, pw, credential, signature, auth, jwt, session or bearer, and OAuth's
  `code`: `?token=...`, `&api_token=...`, `#access_token=...`, `;token=...`, S3 presigned signatures),
  `Authorization:` header values, quoted values of credential keys in JSON or YAML text (`"api_token": "..."`) and
  the common token formats (Hugging Face `hf_...`, AWS access key ids `AKIA...`/`ASIA...`, `sk-...`, GitHub
  `ghp_...`, Slack `xox.-...`, GitLab `glpat-...`, JWTs `eyJ....eyJ....`).

A stage process redacts its own output (`redact_streams`) with its own environment: the secrets of the Ray node
never reach the job log, where the worker's redactor would not know them.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from typing import Any

SECRET_NAME = re.compile(r"^(AWS_.*|RAY_AUTH_TOKEN|.*AUTH_STRING|.*DATABASE_URL|.*_CONNECTION_URL|(.*_)?TOKENS?"
                         r"|.*_TOKEN_.*|.*SECRET.*|.*_KEYS?|.*_KEY_.*|.*APIKEY.*|.*PASSWORD.*|.*PASSWD.*|.*_PASS"
                         r"|.*PASSPHRASE.*|.*CREDENTIAL.*|.*CONNECTION_STRING.*|.*_DSN|.*_PWD|(.*_)?JWT(_.*)?)$")
MIN_SECRET_LENGTH = 8
REDACTED = "[redacted]"
# user:password@ (or a bare token@) between a URL's scheme and its host, up to the authority's last @ (a password
# may hold a raw @)
URL_USERINFO = re.compile(r"(?<=://)[^/\s?#]*@")
# Query, fragment (OAuth's #access_token=) and matrix (;token=) parameters whose name says credential.
CREDENTIAL_PARAMETER = re.compile(
    r"(?i)([?&#;](?:[\w.-]*(?:token|key|secret|pass|pwd|pw|credential|signature|auth|jwt|session|bearer)[\w.-]*"
    r"|sig|code)=)[^&;\s#\"']+"
)
TOKEN_FORMATS = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|(?:AKIA|ASIA)[0-9A-Z]{16}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|github_pat_[A-Za-z0-9_]{20,}|xox[abprs]-[A-Za-z0-9-]{10,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"  # a JWT: base64url header.payload.signature
)
# An Authorization header's credentials, in an HTTP dump or a repr: `Authorization: Bearer <x>`, `'authorization':
# '<x>'`.
AUTHORIZATION_VALUE = re.compile(
    r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|digest)\s+)?)[^\s\"',;}]+"
)
# A quoted value under a key that names a credential, in JSON or YAML text (`"api_token": "..."`); a tokenizer's
# special tokens (eos_token, pad_token, ...) are not credentials.
CREDENTIAL_FIELD = re.compile(
    r"(?i)([\"']?(?<![\w.-])(?!(?:eos|bos|pad|unk|sep|cls|mask)_token)(?:[\w.-]*[_-])?"
    r"(?:token|api[_-]?key|apikey|secret|password|passwd|passphrase|credentials?|jwt|bearer)"
    r"[\"']?\s*[:=]\s*[\"'])[^\"'\n]+"
)


def is_secret_name(name: str) -> bool:
    return bool(SECRET_NAME.match(name.upper()))


def redact_patterns(text: str) -> str:
    """`text` with URL credentials, credential query parameters and known token formats replaced."""
    text = URL_USERINFO.sub(REDACTED + "@", text)
    text = CREDENTIAL_PARAMETER.sub(lambda m: m.group(1) + REDACTED, text)
    text = AUTHORIZATION_VALUE.sub(lambda m: m.group(1) + REDACTED, text)
    text = CREDENTIAL_FIELD.sub(lambda m: m.group(1) + REDACTED, text)
    return TOKEN_FORMATS.sub(REDACTED, text)


def url_credentials(url: str) -> list[str]:
    """What in `url` is a credential (userinfo, credential query parameters, tokens), described for a message."""
    found = []
    if URL_USERINFO.search(url):
        found.append("user:password@ in the URL")
    found += [f"query parameter {m.group(1)[1:-1]!r}" for m in CREDENTIAL_PARAMETER.finditer(url)]
    if TOKEN_FORMATS.search(url):
        found.append("a token in the URL")
    return found


def url_credentials_refusal(flag: str, spec: str) -> str | None:
    """Why the HTTP URLs of a flag's value (comma-separated) may not be used, naming the flag and each URL redacted,
    or None: credentials in a URL would be copied into logs, manifests, checkpoint fingerprints and the UI."""
    found = [(part, what) for part in spec.split(",") if part.strip().startswith(("http://", "https://"))
             and (what := url_credentials(part.strip()))]
    if not found:
        return None
    named = "; ".join(f"{redact_patterns(part.strip())} ({', '.join(what)})" for part, what in found)
    return (f"{flag} {named}: credentials in the URL are refused: they would be copied into logs, manifests and the "
            "UI. Put the Authorization header value in an environment variable of the Ray nodes and name it with "
            "--remote_rm_auth_env")


class Redactor:
    """Replaces the values of the secret variables of an environment (default: this process's) and the secret
    patterns in texts."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        secrets = {value: name for name, value in environ.items()
                   if (is_secret_name(name) or url_credentials(value)) and len(value) >= MIN_SECRET_LENGTH}
        # Longest first, so a secret that contains another is replaced whole.
        self._secrets = sorted(secrets.items(), key=lambda item: -len(item[0]))

    def text(self, text: str) -> str:
        for value, name in self._secrets:
            if value in text:
                text = text.replace(value, f"[redacted {name}]")
        return redact_patterns(text)

    def data(self, value: Any) -> Any:
        """The same structure (dicts, lists, strings, numbers) with secrets replaced in every string."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(str(k)) if isinstance(k, str) else k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.data(v) for v in value)
        return value


class RedactingStream:
    """A text stream that writes whole lines, redacted, to `target`: a secret split over two writes is still
    seen whole. Everything else (fileno, encoding, isatty) is the target's."""

    def __init__(self, target, redactor: Redactor):
        self.target, self.redactor = target, redactor
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, self._pending = self._pending.rsplit("\n", 1)
            self.target.write(self.redactor.text(lines + "\n"))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self.target.write(self.redactor.text(self._pending))
            self._pending = ""
        self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


# Ray runs it in every worker process of a job before the process takes any task (runtime_env's
# worker_process_setup_hook): processes others start for a stage (vLLM's tensor-parallel workers) redact too.
REDACTING_SETUP_HOOK = "infra.secrets.redact_streams"


def redact_streams(redactor: Redactor | None = None, *, outermost: bool = False) -> None:
    """Redact everything this process prints from here on: its stdout and stderr, what Ray's log monitor prints
    there for the process's actors, and the loggers that hold the streams themselves (Ray's, DeepSpeed's, vLLM's:
    their handlers took sys.stdout or sys.stderr when the package was imported, before this ran). `outermost`:
    redact again above whatever now wraps the streams (W&B's console capture patches the stream it finds, and would
    record what it is given before the redaction under it)."""
    import logging

    redactor = redactor or Redactor()
    swapped = {}
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if outermost or not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream, redactor))
        redacting = getattr(sys, name)
        for raw in (redacting.target, getattr(sys, f"__{name}__")):
            swapped[id(raw)] = redacting
    loggers = [logging.getLogger(), *(item for item in logging.Logger.manager.loggerDict.values()
                                      if isinstance(item, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in swapped:
                handler.setStream(swapped[id(handler.stream)])
