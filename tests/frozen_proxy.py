"""Fault injection: a TCP proxy in front of PostgreSQL that freezes like a stopped server.

``FreezingProxy(host, port, trigger)`` listens on 127.0.0.1 and forwards
each client connection to the server. Once a client sends bytes containing
``trigger`` (a piece of SQL, say ``b"INSERT INTO entries"``), that connection
freezes: everything either side sends is read and dropped, so the client's
writes are acknowledged, as a stopped server's kernel acknowledges them, and
no reply ever comes. The server side is left open (its transaction, and any
lock it holds, stays open) until ``close()``, which closes every connection;
the server then rolls back whatever was not committed, as it would when a
frozen client host went away.

Other connections, and a connection before its trigger, pass through
unchanged. ``frozen`` counts the connections frozen so far. The proxy is a
test's stand-in for a frozen server; the server behind it is real.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class FreezingProxy:
    def __init__(self, host: str, port: int, trigger: bytes) -> None:
        self.target = (host, port)
        self.trigger = trigger
        self.frozen = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            state = {"frozen": False}
            threading.Thread(
                target=self._pump, args=(client, server, state, True), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(server, client, state, False), daemon=True
            ).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, state: dict[str, bool], upstream: bool
    ) -> None:
        seen = b""
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            if upstream and not state["frozen"]:
                seen = (seen + data)[-(len(data) + len(self.trigger)) :]
                if self.trigger in seen:
                    with self._lock:
                        state["frozen"] = True
                        self.frozen += 1
            if state["frozen"]:
                continue  # read and dropped: acknowledged, never answered
            try:
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@contextmanager
def freezing_proxy(host: str, port: int, trigger: bytes) -> Iterator[FreezingProxy]:
    proxy = FreezingProxy(host, port, trigger)
    try:
        yield proxy
    finally:
        proxy.close()
