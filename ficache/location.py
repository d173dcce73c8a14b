"""Where a registry lives: ``--db``, ``FICACHE_DB`` or the default, resolved to a ``Location``.

``resolve`` is the one place a name becomes a ``Location``: a path (``~``
expanded, made absolute), ``sqlite:///PATH``, or a server URL, where
``postgres://`` and ``postgresql://`` mean ``postgresql+psycopg://``; with
nothing given, ``registry.db`` in the user cache dir (platformdirs).

Invariants:
- Importing this module imports no SQLAlchemy: a warm start on a SQLite file
  resolves its registry here and reads it through ``ficache.sqlite_fast``
  without loading an engine. A URL (``://``) is parsed with SQLAlchemy's
  ``make_url``, imported then, so SQLite paths and URLs keep one grammar.
- It opens no database. It reads a file's mode bits (``is_read_only_file``)
  and refuses names that cannot be used at all (not UTF-8, not resolvable)
  with a ``RegistryError`` saying what to give instead; whether a file is a
  registry is ``ficache.schema``'s question.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ficache.errors import RegistryError

ENV_VAR = "FICACHE_DB"

#: The registry URLs ficache is built for, as error messages name them.
ACCEPTED_FORMS = (
    "a SQLite file path, sqlite:///PATH, or postgresql+psycopg://USER@HOST/DATABASE "
    "(postgres:// and postgresql:// mean the same)"
)
#: The PostgreSQL driver ficache ships with (the ``ficache[postgres]`` extra, psycopg 3).
POSTGRES_DRIVERNAME = "postgresql+psycopg"


def default_registry_path() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ficache", appauthor=False)) / "registry.db"


@dataclass(frozen=True)
class Location:
    """Where a registry lives, resolved once from ``--db`` / env / default."""

    url: str
    path: Path | None  # the SQLite file, when it is one

    @property
    def display(self) -> str:
        """The location as messages show it: the file's path, or the URL without its password."""
        if self.path is not None:
            return str(self.path)
        from sqlalchemy.engine import make_url

        return make_url(self.url).render_as_string(hide_password=True)


def resolve(db: str | os.PathLike[str] | None = None) -> Location:
    """Where ``db`` (else ``FICACHE_DB``, else the default) names a registry.

    ``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``
    (libpq's scheme, which SQLAlchemy does not know, and SQLAlchemy's without
    a driver, which picks psycopg2 before SQLAlchemy 2.1, a driver ficache
    does not ship); ``postgres+DRIVER://`` becomes
    ``postgresql+DRIVER://``. Every other URL is kept as given.
    """
    raw = os.fspath(db) if db is not None else os.environ.get(ENV_VAR) or None
    if raw is None:
        path = default_registry_path()
        return Location(f"sqlite:///{path}", path)
    if "://" in raw:
        return _resolve_url(raw)
    path = _local_path(raw)
    return Location(f"sqlite:///{path}", path)


def _resolve_url(raw: str) -> Location:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(raw)
    except ArgumentError:
        raise RegistryError(f"cannot parse registry URL {raw!r}; give {ACCEPTED_FORMS}") from None
    backend, _, driver = url.drivername.partition("+")
    if backend in ("postgres", "postgresql"):
        named = f"postgresql+{driver}" if driver else POSTGRES_DRIVERNAME
        if named != url.drivername:
            url = url.set(drivername=named)
            return Location(url.render_as_string(hide_password=False), None)
        return Location(raw, None)
    if url.get_backend_name() == "sqlite":
        database = url.database
        if database and database != ":memory:" and not database.startswith("file:"):
            path = _local_path(database)
            return Location(f"sqlite:///{path}", path)
    return Location(raw, None)


def is_new_sqlite_file(location: Location) -> bool:
    """True when ``location`` is a SQLite file that does not exist yet: a write creates it.

    Callers say so before the first write creates it (the CLI on stderr):
    a mistyped ``--db`` would otherwise give a new, empty registry silently.
    """
    return location.path is not None and not location.path.exists()


def _local_path(text: str) -> Path:
    """``text`` as an absolute path, ``~`` and ``~user`` expanded.

    SQLite takes file names as UTF-8, so a name that is not (bytes Python
    decoded with surrogateescape) is refused here, as is a path the file
    system cannot look up at all (too long, a file used as a directory...).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RegistryError(
            f"registry path {ascii(text)} is not valid UTF-8, which SQLite needs; "
            "rename the file or give another --db"
        ) from None
    try:
        path = Path(text).expanduser().resolve()
        path.exists()  # raises for names the file system cannot look up
    except RuntimeError as exc:  # ~user without a home directory; a symlink loop
        raise RegistryError(
            f"cannot use registry path {text!r} ({exc}); give another --db"
        ) from None
    except OSError as exc:
        raise RegistryError(
            f"cannot use registry path {text!r}: {exc.strerror or exc}; give another --db"
        ) from None
    return path


def is_read_only_file(path: Path) -> bool:
    """True when ficache may only read the existing registry file ``path``.

    os.access says yes to root for any file; a file without write bits
    (chmod a-w) is read-only for everyone, root included. A read-only mount
    or directory makes it read-only too (SQLite writes its WAL beside it).
    """
    has_write_bits = bool(path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    writable = has_write_bits and os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    return not writable
