"""A TCP forwarder that a test can take down and bring back: an endpoint outage without losing the server's
state (moto keeps its buckets in memory, so stopping moto itself would lose them)."""

from __future__ import annotations

import socket
import threading


class TcpProxy:
    """Listens on 127.0.0.1:<port> and forwards each connection to `target`; `stop()` closes the listener
    and cuts every open connection (clients see refused/reset connections), `start()` listens again on the
    same port."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self.sent: list[bytes] = []  # what clients sent, chunk by chunk (a test reads the HTTP request lines in it)
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TcpProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            try:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()  # linger 0: the peer gets a reset, as from a server that went away
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # stopped meanwhile
                    client.close()
                    upstream.close()
                    return
                self._connections.update((client, upstream))
            for source, sink, record in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(source, sink, record), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, record: bool) -> None:
        try:
            while data := source.recv(65536):
                if record:
                    self.sent.append(data)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for conn in (source, sink):
                try:
                    conn.close()
                except OSError:
                    pass
            with self._lock:
                self._connections.discard(source)
                self._connections.discard(sink)
