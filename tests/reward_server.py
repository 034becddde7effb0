"""A real HTTP reward endpoint on 127.0.0.1 for the tests: the tiny task's rule reward, or an endpoint that
misbehaves (slow, truncated answers, not JSON, refusing requests without the expected Authorization header,
redirecting elsewhere, answering a byte at a time, announcing a huge answer, not announcing its size)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stages.tiny import reward_func as tiny_reward


class RewardServer:
    """A real HTTP reward endpoint on 127.0.0.1 answering the tiny task's rule reward (optionally misbehaving)."""

    def __init__(self, delay_s: float = 0.0, answer=None, misbehave: str = "", token: str | None = None,
                 redirect_to: str = ""):  # fmt: skip
        self.requests: list[int] = []
        self.authorizations: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(len(body["query"]))
                server.authorizations.append(self.headers.get("Authorization"))
                time.sleep(delay_s)
                if token is not None and self.headers.get("Authorization") != token:
                    self.send_error(401)
                    return
                if redirect_to:
                    self.send_response(307)  # 307 keeps the method and the body
                    self.send_header("Location", redirect_to)
                    self.end_headers()
                    return
                rewards = tiny_reward(body["query"], body["prompts"], body["labels"]).tolist()
                payload = json.dumps(answer if answer is not None else {"rewards": rewards}).encode()
                if misbehave == "not json":
                    payload = b"<html>502 Bad Gateway</html>"
                elif misbehave == "nested":  # JSON deeper than the decoder recurses
                    payload = b'{"rewards": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                # "truncated": the length promised, half of the body sent, the connection closed
                if misbehave != "unsized":  # "unsized": no length, the answer ends when the connection closes
                    self.send_header("Content-Length", str(200 * 2**20 if misbehave == "huge" else len(payload)))
                self.end_headers()
                if misbehave == "drip":  # the whole answer, one byte every 0.2 s
                    for byte in payload:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(0.2)
                    return
                self.wfile.write(payload[: len(payload) // 2] if misbehave == "truncated" else payload)
                if misbehave == "truncated":
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
