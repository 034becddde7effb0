"""HTTP endpoints that fail the way S3 and the Hugging Face Hub fail, injected from the tests: an HTTP proxy in front
of the moto server that answers 503 SlowDown, 500 InternalError or 403 AccessDenied instead of forwarding, for the
next N requests or until healed; and a hub stand-in that tells one dataset's revision, or fails the same ways."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

S3_ERRORS = {503: "SlowDown", 500: "InternalError", 403: "AccessDenied", 404: "NoSuchKey"}
HUB_REVISION = "0123456789abcdef0123456789abcdef01234567"


class FaultyEndpoint:
    """Listens on 127.0.0.1; `fail(status, times)` makes the next `times` requests (None: every one until `heal()`)
    answer `status`; other requests are forwarded to `upstream` ("host:port"), or answered by `answer(path)`."""

    def __init__(self, upstream: str | None = None, answer=None):
        self.upstream, self.answer = upstream, answer
        self.status: int | None = None
        self.remaining: int | None = None
        self.failed = 0
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_request(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = endpoint._take_fault()
                if status is not None:
                    code = S3_ERRORS[status]
                    payload = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code>"
                               f"<Message>injected {status}</Message></Error>").encode()
                    headers = {"Content-Type": "application/xml"}
                    if status == 404:
                        headers["X-Error-Code"] = "RepoNotFound"  # what the hub says of an unknown repository
                    self._reply(status, headers, payload)
                elif endpoint.upstream is None:
                    self._reply(200, {"Content-Type": "application/json"}, json.dumps(endpoint.answer(self.path)).encode())
                else:
                    self._forward(body)

            def _forward(self, body: bytes):
                connection = http.client.HTTPConnection(endpoint.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "expect")}
                connection.request(self.command, self.path, body=body or None, headers=headers)
                response = connection.getresponse()
                payload = response.read()
                forwarded = {k: v for k, v in response.getheaders()
                             if k.lower() not in ("connection", "transfer-encoding", "content-length")}
                self._reply(response.status, forwarded, payload)
                connection.close()

            def _reply(self, status: int, headers: dict, payload: bytes):
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = handle_request

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def fail(self, status: int, times: int | None = None) -> None:
        with self._lock:
            self.status, self.remaining = status, times

    def heal(self) -> None:
        self.fail(None)  # type: ignore[arg-type]

    def _take_fault(self) -> int | None:
        with self._lock:
            if self.status is None:
                return None
            status = self.status
            if self.remaining is not None:
                self.remaining -= 1
                if self.remaining <= 0:
                    self.status = None
            self.failed += 1
            return status

    def close(self) -> None:
        if self.httpd.socket.fileno() != -1:
            self.httpd.shutdown()
            self.httpd.server_close()


def hub_answer(path: str) -> dict:
    """The hub's answer to a dataset or model info request: its id and revision."""
    repository = path.removeprefix("/api/datasets/").removeprefix("/api/models/").split("/revision/")[0]
    return {"id": repository, "sha": HUB_REVISION, "private": False}
