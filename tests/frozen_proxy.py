"""Fault injection: TCP proxies in front of PostgreSQL: one freezes like a stopped server.

``ResettingProxy`` (below) instead resets a connection just after forwarding
its COMMIT: a commit that landed while its client saw the connection reset.

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
import struct
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


class ResettingProxy:
    """A TCP proxy that resets a connection just after it forwarded its COMMIT.

    Once a client connection has sent ``armed_by`` (``b"INSERT INTO entries"``,
    say), the next bytes holding ``trigger`` (``b"COMMIT"``) are forwarded to
    the server, which commits; then, after ``delay_s``, both sides of that
    connection are reset (``SO_LINGER`` 0), so the client never reads the
    server's answer: a commit that landed while its client saw a reset. Only
    the first ``times`` such connections are reset; ``resets`` counts them.
    """

    def __init__(
        self,
        host: str,
        port: int,
        armed_by: bytes,
        trigger: bytes = b"COMMIT",
        *,
        delay_s: float = 0.3,
        times: int = 1,
    ) -> None:
        self.target = (host, port)
        self.armed_by, self.trigger, self.delay_s = armed_by, trigger, delay_s
        self.times = times
        self.resets = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, database: str, user: str = "postgres") -> str:
        return f"postgresql+psycopg://{user}@127.0.0.1:{self.port}/{database}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            state = {"cut": False}
            threading.Thread(target=self._up, args=(client, server, state), daemon=True).start()
            threading.Thread(target=self._down, args=(server, client, state), daemon=True).start()

    def _up(self, client: socket.socket, server: socket.socket, state: dict[str, bool]) -> None:
        armed = False
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    server.shutdown(socket.SHUT_WR)
                return
            armed = armed or self.armed_by in data
            fire = False
            if armed and self.trigger in data:
                with self._lock:
                    fire = self.resets < self.times
                    self.resets += fire
                state["cut"] = fire  # the server's answer to it never reaches the client
            try:
                server.sendall(data)
            except OSError:
                return
            if fire:
                threading.Timer(self.delay_s, _reset, (client, server)).start()
                return

    def _down(self, server: socket.socket, client: socket.socket, state: dict[str, bool]) -> None:
        while True:
            try:
                data = server.recv(65536)
                if not data:
                    break
                if not state["cut"]:
                    client.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()


def _reset(*sockets: socket.socket) -> None:
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
