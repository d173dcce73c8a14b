"""Engines, connection settings and schema migrations run in code.

Where a registry lives is ``ficache.location``'s (re-exported here:
``resolve``, ``Location``); this module opens what it names: a database
SQLAlchemy does not know, or a driver that is missing, is one
``RegistryError`` naming the accepted forms (``make_engine``).

Invariants:
- SQLite connections use WAL, a busy timeout and foreign keys. A write
  transaction begins with ``BEGIN IMMEDIATE`` so two writers queue on the
  lock instead of failing on a read-to-write upgrade.
- How long a write waits for the write lock is the engine's own setting
  (``BUSY_TIMEOUT_MS`` unless ``bound_busy_timeout`` lowered it; read with
  ``busy_timeout_ms``): SQLite's busy timeout of every new connection, the
  ``lock_timeout`` of every PostgreSQL write transaction. A
  ``RegistryBusyError`` states that bound, and the time waited where the
  caller measured it.
- A path that exists and is not a SQLite file is refused before SQLite
  touches it. A read-only file is opened read-only: immutable when its WAL
  holds nothing, else through its WAL, so no commit is missed; one whose
  WAL cannot be read where it lies is refused (``_read_only_query``).
- The schema changes only through Alembic revisions, under the registry's
  write lock (``BEGIN IMMEDIATE`` on SQLite, an advisory lock on
  PostgreSQL), after reading the revision again inside the lock.
- Rolling upgrades (servers of two ficache versions share one registry).
  Each revision module declares ``readable_from`` and ``writable_from``: the
  oldest schema heads whose code can still read and write that revision (a
  revision that only adds is readable, often writable, by the code before
  it). From ``0007_compat`` on, the registry stores them for its current
  revision in ``schema_compat``, rewritten by every upgrade and downgrade
  (``_stamp_compat``), because only the registry can tell older code about
  a revision it does not know.
- A registry whose revision this code does not know is newer than the code.
  Where its ``schema_compat`` row names a ``readable_from`` this code knows,
  it is used: served, and committed to when ``writable_from`` is known too
  (else each write is refused with one line, ``write_refusal``); its schema
  is never changed. Otherwise (no row: written before 0007, or by a tool
  that moved the revision) it is refused with ``SchemaTooNewError`` and
  never written.
- Older schemas (this code on a registry the previous releases share).
  ``features_of`` resolves, when a registry opens (``ensure_schema``), what
  its revision lacks of this code's head (``SchemaFeatures``), from the
  revision modules above it: each declares ``adds`` (in words),
  ``adds_tables`` and ``adds_columns``. The oldest revision this code uses
  is the first one, walking down from head, that declares none: every
  revision above it does (``oldest_readable``; ``0007_compat`` today). Such a registry is read and
  written as it is, never upgraded: the engine carries the features
  (``features``), so each query touching an added table or column asks them
  (a missing table reads as empty, ``kind_store.present``; a missing column
  as its default, ``SchemaFeatures.column``/``columns``; writes leave it
  out, ``writable``), and a write that leaves something out says so once
  (``SchemaFeatures.skipped``, ``WriteResult.skipped``).
- Expand, then contract. A revision adds only (tables, columns with server
  defaults, indexes), declares what it adds as above, and names in
  ``readable_from``/``writable_from`` the oldest release that can read and
  write it: one that only adds is readable by the release before it. A
  change that removes or reshapes what a previous release reads (a column
  dropped, renamed, retyped, made NOT NULL without a default; a table split)
  ships in two releases: first the release that no longer needs the old
  shape (adding the new one beside it and writing both), then a later
  revision that drops the old shape, declaring no ``adds_*`` (so this code's
  ``oldest_readable`` moves up to it) and a ``readable_from`` of that first
  release. ``tests/test_rolling_upgrade.py`` checks every revision this code
  reads against the previous two releases' frozen registries.
- Reads never change the schema (``ensure_schema(write=False)``): a schema
  older than ``oldest_readable`` is refused with ``SchemaTooOldError``, "run
  `ficache db upgrade`". A write creates a new registry at head; it upgrades
  such an older schema only in a local SQLite file (and says so:
  ``SchemaCheck.upgraded_from``). A server-backed registry (PostgreSQL,
  shared by a fleet) is upgraded only by ``ficache db upgrade``
  (``plan_upgrade``: the revisions applied and the releases that then stop
  writing or reading it, ``release_access``; ``upgrade_sql``: the same as
  SQL, Alembic's offline mode).
- A downgrade is planned first (``plan_downgrade``): each revision undone
  says what it drops, counted from the registry (its module's
  ``lost_on_downgrade``), and the plan executes only at the revision it was
  made at.
- PostgreSQL (``postgresql+psycopg://``, the ``ficache[postgres]`` extra)
  behaves like SQLite: writers queue on one transaction-scoped advisory
  lock, and the wait for it is bounded (``SET LOCAL lock_timeout``, like
  SQLite's busy timeout) and reported as ``RegistryBusyError``; connecting
  gives up after ``CONNECT_TIMEOUT_S``. A server that cannot be reached or drops the
  connection is one ``RegistryUnavailableError`` line, never a driver's multi-line
  text, naming its cause and that cause's remedy (``connection_trouble``, the one
  table of causes). A lost connection is recognised by what the error is, never by
  its text (``connection_lost``); a cause that may pass by itself (too many clients, a server
  starting up or shutting down, a refused or reset connection, a serialization
  failure or deadlock) is marked ``transient`` for ``ficache.retrying``.
  Its engines are watched by ``ficache.deadline``, so a caller can bound
  work on a server that stops answering mid-query.
- Opening without ``create`` never creates a registry: a missing SQLite file
  and a database without any table are refused.
"""

from __future__ import annotations

import functools
import os
import sqlite3
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from sqlalchemy import (
    Connection,
    Engine,
    Table,
    create_engine,
    event,
    inspect,
    literal_column,
    text,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DatabaseError,
    IntegrityError,
    NoSuchModuleError,
    OperationalError,
)
from sqlalchemy.pool import NullPool

if TYPE_CHECKING:
    # Alembic loads where a schema is read or changed, never on a warm start's
    # fast path (``ficache.slices.cached_slices``).
    from alembic.config import Config
    from alembic.script import ScriptDirectory

from ficache.deadline import watch_engine
from ficache.errors import (
    ConflictError,
    NotARegistryError,
    RegistryBusyError,
    RegistryError,
    RegistryReadOnlyError,
    RegistryUnavailableError,
    SchemaError,
    SchemaTooNewError,
    SchemaTooOldError,
)

# Re-exported: callers that open registries name locations through this module.
from ficache.location import ACCEPTED_FORMS as ACCEPTED_FORMS
from ficache.location import ENV_VAR as ENV_VAR
from ficache.location import POSTGRES_DRIVERNAME as POSTGRES_DRIVERNAME
from ficache.location import Location as Location
from ficache.location import default_registry_path as default_registry_path
from ficache.location import is_new_sqlite_file as is_new_sqlite_file
from ficache.location import is_read_only_file as is_read_only_file
from ficache.location import resolve as resolve
from ficache.migration_files import declared_head as declared_head
from ficache.migration_files import migrations_dir as migrations_dir

BUSY_TIMEOUT_MS = 30_000
#: Engine execution option: the milliseconds a write waits for the write lock.
LOCK_TIMEOUT_OPTION = "ficache_lock_timeout_ms"
CONNECT_TIMEOUT_S = 10
SQLITE_MAGIC = b"SQLite format 3\x00"
# Arbitrary constant naming ficache's migration lock on PostgreSQL.
PG_MIGRATION_LOCK_ID = 0x6669636163686501
#: The table (from ``0007_compat``) that says which older ficache may read and write the schema.
COMPAT_TABLE = "schema_compat"


def _check_sqlite_file(path: Path) -> bool:
    """Validate an existing file; return True when it may only be read."""
    if path.is_dir():
        raise NotARegistryError(
            f"{path} is a directory; give the registry's file path (e.g. {path}/registry.db)"
        )
    try:
        with path.open("rb") as handle:
            head = handle.read(len(SQLITE_MAGIC))
    except PermissionError:
        raise RegistryError(f"cannot read registry {path}: permission denied") from None
    if head and head != SQLITE_MAGIC:
        raise NotARegistryError(
            f"{path} is not a SQLite database; pass another --db or move the file away"
        )
    return is_read_only_file(path)


#: A WAL file's header; frames (commits not yet copied into the database) follow it.
WAL_HEADER_BYTES = 32


def _read_only_query(path: Path) -> dict[str, str]:
    """The URI parameters that open the read-only registry ``path`` with every commit.

    ``immutable=1`` reads the database file alone, without locks or a
    ``-shm`` beside it: right for a file whose WAL is gone or empty (every
    ficache write leaves it so on closing), and the only way to read one on
    a read-only mount without its ``-shm``. A WAL that still holds frames
    (a writer was killed, or a copy was taken while one was open) holds
    commits the file lacks; ``immutable`` would ignore them. Such a registry
    is opened ``mode=ro`` instead, which reads the WAL through its ``-shm``
    (SQLite makes one where the directory is writable, and reads an existing
    one on a read-only mount). Where neither works, the registry is refused:
    reading it without those commits would lose them silently.
    """
    wal = path.with_name(path.name + "-wal")
    try:
        wal_bytes = wal.stat().st_size
    except OSError:
        wal_bytes = 0
    if wal_bytes <= WAL_HEADER_BYTES:
        return {"mode": "ro", "immutable": "1", "uri": "true"}
    try:
        probe = sqlite3.connect(f"file:{quote(str(path))}?mode=ro", uri=True)
        try:
            probe.execute("SELECT count(*) FROM sqlite_master").fetchone()
        finally:
            probe.close()
    except sqlite3.Error as exc:
        raise RegistryReadOnlyError(
            f"registry {path} is read-only and its WAL ({wal.name}, {wal_bytes} bytes) holds "
            f"commits that cannot be read here ({exc}); run any ficache command on it where "
            "it is writable (that folds the WAL in), or copy it with its -wal and -shm files"
        ) from None
    return {"mode": "ro", "uri": "true"}


def copy_sqlite_file(path: Path, copy: Path) -> None:
    """Copy the SQLite registry ``path`` (with what its WAL holds) to ``copy``, reading only."""
    source = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    try:
        target = sqlite3.connect(copy)
        try:
            source.backup(target)
        finally:
            target.close()
    finally:
        source.close()


def _install_sqlite_events(engine: Engine, *, readonly: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event, not pysqlite, open transactions.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms(engine)}")
        cursor.execute("PRAGMA foreign_keys = ON")
        if not readonly:
            # WAL is set by ensure_schema once the file is known to be a
            # registry: setting it here would write to foreign or newer files.
            cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        if conn.get_execution_options().get("ficache_write"):
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        else:
            conn.exec_driver_sql("BEGIN")


def bound_busy_timeout(engine: Engine, seconds: float | None) -> None:
    """Make ``engine``'s later writes wait at most ``seconds`` for the write lock.

    ``None`` leaves the bound as it is. SQLite: the busy timeout of every
    connection opened from now on. PostgreSQL: the ``lock_timeout`` of every
    write transaction (``write_transaction``).
    """
    if seconds is None:
        return
    engine.update_execution_options(**{LOCK_TIMEOUT_OPTION: max(int(seconds * 1000), 0)})


def busy_timeout_ms(engine: Engine | None) -> int:
    """The milliseconds ``engine``'s writes wait for the write lock (``None``: the default)."""
    if engine is None:
        return BUSY_TIMEOUT_MS
    return int(engine.get_execution_options().get(LOCK_TIMEOUT_OPTION, BUSY_TIMEOUT_MS))


def make_engine(location: Location, *, create: bool = True) -> tuple[Engine, bool]:
    """Return ``(engine, readonly)`` for ``location``.

    ``create=False`` refuses a SQLite path that does not exist yet.
    """
    if location.path is not None:
        return _sqlite_file_engine(location.path, create=create)
    return _url_engine(location), False


def _sqlite_file_engine(path: Path, *, create: bool) -> tuple[Engine, bool]:
    """The engine of a SQLite file (read-only where the file is), checked or made first."""
    readonly = False
    if path.exists():
        readonly = _check_sqlite_file(path)
    elif not create:
        raise RegistryError(
            f"no registry at {path}; import a cache file first (ficache import FILE)"
        )
    else:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RegistryError(
                f"cannot create directory for registry {path}: {exc.strerror}"
            ) from None
        if not os.access(path.parent, os.W_OK):
            raise RegistryReadOnlyError(
                f"cannot create registry {path}: directory is not writable; pass --db or set {ENV_VAR}"
            )
    if readonly:
        # A URI filename: percent-encode it, or a '#' or '?' in the path
        # would cut it short (and SQLite would create the shorter path).
        url = URL.create(
            "sqlite",
            database=f"file:{quote(str(path))}",
            query=_read_only_query(path),
        )
    else:
        url = URL.create("sqlite", database=str(path))  # no URL parsing: '%', '?' are path text
    engine = create_engine(url, poolclass=NullPool)
    _install_sqlite_events(engine, readonly=readonly)
    return engine, readonly


def _url_engine(location: Location) -> Engine:
    """The engine of a database URL; a driver or database SQLAlchemy lacks is one line."""
    url = make_url(location.url)
    connect_args: dict[str, Any] = {}
    if url.get_backend_name() == "postgresql" and "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = CONNECT_TIMEOUT_S  # the URL's own wins
    try:
        engine = create_engine(location.url, pool_pre_ping=True, connect_args=connect_args)
    except ImportError as exc:
        if url.get_backend_name() != "postgresql":
            hint = f"install its driver, or give {ACCEPTED_FORMS}"
        elif url.drivername == POSTGRES_DRIVERNAME:
            hint = "install the PostgreSQL driver: pip install 'ficache[postgres]'"
        else:
            hint = (
                "install the PostgreSQL driver: pip install 'ficache[postgres]' "
                f"(and use a {POSTGRES_DRIVERNAME}:// URL)"
            )
        raise RegistryError(f"cannot use registry URL {location.display}: {exc}; {hint}") from None
    except NoSuchModuleError:
        raise RegistryError(
            f"cannot use registry URL {location.display}: SQLAlchemy knows no database "
            f"{url.drivername!r}; give {ACCEPTED_FORMS}"
        ) from None
    except ArgumentError as exc:
        raise RegistryError(
            f"cannot use registry URL {location.display}: {exc}; give {ACCEPTED_FORMS}"
        ) from None
    if engine.dialect.name == "sqlite":
        _install_sqlite_events(engine, readonly=False)
    elif engine.dialect.name == "postgresql":
        watch_engine(engine)  # a frozen server ends in an error under registry_deadline
    return engine


# --------------------------------------------------------------------------
# Alembic, configured in code.


def alembic_config(connection: Connection | None = None) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # One path, never split on spaces (an install under "My Projects/").
    config.set_main_option("path_separator", "os")
    config.set_main_option("version_locations", str(migrations_dir() / "versions"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


def _alembic_command() -> Any:
    """``alembic.command``, imported when a schema changes."""
    from alembic import command

    return command


@functools.lru_cache(maxsize=1)
def script_directory() -> ScriptDirectory:
    """The installed revisions (read once per process: they cannot change under it)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    head = script_directory().get_current_head()
    assert head is not None
    return head


def current_revision(connection: Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(connection).get_current_revision()


def _is_foreign_database(connection: Connection) -> bool:
    tables = set(inspect(connection).get_table_names())
    return bool(tables) and "alembic_version" not in tables


@contextmanager
def write_transaction(engine: Engine) -> Iterator[Connection]:
    """One write transaction holding the registry's write lock.

    On PostgreSQL the wait for the lock is bounded by ``busy_timeout_ms``
    (the engine's ``bound_busy_timeout``), set for this transaction only
    (``SET LOCAL``: safe behind a connection pooler).
    """
    with engine.connect() as conn:
        conn = conn.execution_options(ficache_write=True)
        with conn.begin():
            if conn.dialect.name == "postgresql":
                options = conn.get_execution_options()
                timeout_ms = int(options.get(LOCK_TIMEOUT_OPTION, BUSY_TIMEOUT_MS))
                conn.execute(text(f"SET LOCAL lock_timeout = {max(timeout_ms, 1)}"))
                conn.execute(
                    text("SELECT pg_advisory_xact_lock(:id)"), {"id": PG_MIGRATION_LOCK_ID}
                )
            yield conn


@dataclass(frozen=True)
class ConnectionTrouble:
    """Why a registry server could not be used, whether it may pass, and what to do."""

    cause: str
    transient: bool
    remedy: str


_UNREACHABLE = ConnectionTrouble("", False, "check that the server runs and the URL is right")
#: An established connection that went away (``connection_lost``): asked again.
_DROPPED = ConnectionTrouble(
    "the connection was reset or dropped",
    True,
    "check the server and the network between; retry",
)

#: The one table of connection causes: (SQLSTATEs, driver phrases, trouble). First match wins.
_TROUBLES: tuple[tuple[tuple[str, ...], tuple[str, ...], ConnectionTrouble], ...] = (
    (
        ("53300",),
        ("too many clients", "remaining connection slots are reserved", "too many connections"),
        ConnectionTrouble(
            "the server has no free connection (too many clients)",
            True,
            "raise max_connections on the server or put a pooler such as PgBouncer in front",
        ),
    ),
    (
        (),
        ("the database system is starting up", "not yet accepting connections"),
        ConnectionTrouble(
            "the server is starting up",
            True,
            "wait for it to accept connections; if it stays so, check the server's log",
        ),
    ),
    (
        ("57P01", "57P02"),
        ("the database system is shutting down", "terminating connection due to administrator"),
        ConnectionTrouble(
            "the server is shutting down or restarting",
            True,
            "wait for it to come back; if it does not, check the server and its log",
        ),
    ),
    (
        ("57P03",),
        ("the database system is in recovery", "cannot connect now"),
        ConnectionTrouble(
            "the server is not accepting connections yet",
            True,
            "wait for it to finish starting or recovering; check the server's log",
        ),
    ),
    (
        ("3D000", "28000", "28P01"),
        ("does not exist", "authentication failed", "no pg_hba.conf entry"),
        _UNREACHABLE,
    ),
    (
        (),
        ("connection refused",),
        ConnectionTrouble(
            "the connection was refused", True, "check that the server runs and the URL is right"
        ),
    ),
    (
        (),
        ("timeout expired", "connection timeout"),
        # Not retried: the URL's connect_timeout is the user's bound on a silent host.
        _UNREACHABLE,
    ),
)


def connection_trouble(message: str, sqlstate: str | None = None) -> ConnectionTrouble | None:
    """The cause of a connection failure named by ``sqlstate`` or the driver's ``message``.

    None: not a connection cause this table knows (the caller decides). The
    driver's phrase decides (it tells "starting up" from "shutting down", which
    share 57P03), else the SQLSTATE. Call it only for an error that is about the
    connection: some phrases ("does not exist") mean other things elsewhere.
    """
    lowered = message.lower()
    for _codes, phrases, trouble in _TROUBLES:
        if any(phrase in lowered for phrase in phrases):
            return trouble
    for codes, _phrases, trouble in _TROUBLES:
        if sqlstate is not None and sqlstate in codes:
            return trouble
    return None


def _driver_errors(name: str) -> tuple[type[BaseException], ...]:
    """``name``'s (``psycopg``, ``psycopg2``) ``OperationalError``, if that driver is loaded.

    A driver not imported yet cannot have raised, so it is not imported here.
    """
    module = sys.modules.get(name)
    error = getattr(module, "OperationalError", None)
    return (error,) if isinstance(error, type) else ()


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says an established connection to the server went away.

    Recognised by what the error is, never by its text: SQLAlchemy found the
    connection invalidated (its dialect's ``is_disconnect``: psycopg's
    connection ``closed`` or ``broken``); the SQLSTATE is of class 08
    (connection exception); or psycopg raised an ``OperationalError`` of its
    own (no SQLSTATE: not the server's answer) outside a connection attempt
    (no ``pgconn``: those are ``connection_trouble``'s) that is not its
    connect timeout, such as "connection socket closed".
    """
    if getattr(exc, "connection_invalidated", False):
        return True
    orig = getattr(exc, "orig", None)
    if (_sqlstate(orig) or "").startswith("08"):
        return True
    psycopg_errors = _driver_errors("psycopg")
    if not psycopg_errors or not isinstance(orig, psycopg_errors):
        return False
    timeout = getattr(getattr(sys.modules["psycopg"], "errors", None), "ConnectionTimeout", None)
    return (
        _sqlstate(orig) is None
        and getattr(orig, "pgconn", None) is None
        and not (isinstance(timeout, type) and isinstance(orig, timeout))
    )


def _sqlstate(orig: BaseException | None) -> str | None:
    """The SQLSTATE of a driver's error (psycopg's ``sqlstate``, psycopg2's ``pgcode``)."""
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def _about_the_connection(exc: BaseException, sqlstate: str | None) -> bool:
    """Whether ``exc`` is about reaching the server, not about the work sent to it.

    The connection went away (``connection_lost``); the SQLSTATE is of class 08,
    53300 (too many clients) or 57P (the server shutting down or starting up);
    or the PostgreSQL driver failed on its own side (an ``OperationalError``
    without a SQLSTATE: it could not connect, or lost the connection).
    """
    if connection_lost(exc) or (sqlstate or "").startswith(("08", "53300", "57P")):
        return True
    orig = getattr(exc, "orig", None)
    drivers = _driver_errors("psycopg") + _driver_errors("psycopg2")
    return bool(drivers) and isinstance(orig, drivers) and sqlstate is None


def _seconds(milliseconds: int) -> str:
    return f"{milliseconds / 1000:g} s"


def busy_error(
    location: Location,
    bound_ms: int,
    *,
    waited_s: float | None = None,
    attempts: int = 1,
) -> RegistryBusyError:
    """The one line for a write lock another writer kept past ``bound_ms`` (per attempt)."""
    bound = _seconds(bound_ms)
    if waited_s is None:
        how_long = f"longer than the {bound} a write waits for the lock"
    elif attempts > 1:
        how_long = (
            f"for {waited_s:.1f} s ({attempts} attempts, each waiting up to {bound} for the lock)"
        )
    else:
        how_long = f"for {waited_s:.1f} s (a write waits up to {bound} for the lock)"
    return RegistryBusyError(
        f"registry {location.display} stayed locked by another writer {how_long}; "
        "retry when it finishes"
    )


def translate_operational_error(
    exc: DatabaseError,
    location: Location,
    *,
    engine: Engine | None = None,
    waited_s: float | None = None,
    attempts: int = 1,
) -> RegistryError:
    """One ``RegistryError`` line for a driver's error.

    ``engine`` (the one that failed) gives the lock wait a busy error states
    (else the default, ``BUSY_TIMEOUT_MS``); ``waited_s`` and ``attempts``,
    where the caller measured them, how long it actually waited.

    One body on purpose: it is the one table from a driver's error (SQLite's
    and PostgreSQL's, by exception class and message text) to ficache's
    classes and their remedies, read top to bottom in the order the cases
    are tried, where the first match wins.
    """
    message = str(exc.orig) if getattr(exc, "orig", None) is not None else str(exc)
    lowered = message.lower()
    first_line = " ".join(message.strip().splitlines()[0].split()) if message.strip() else ""
    if isinstance(exc, IntegrityError):  # deterministic: the same write breaks it again
        return RegistryError(
            f"registry {location.display} refused the write ({first_line}); nothing was "
            "written; check it with `ficache verify`"
        )
    sqlstate = _sqlstate(getattr(exc, "orig", None))
    if _about_the_connection(exc, sqlstate):
        trouble = connection_trouble(lowered, sqlstate) or (
            _DROPPED if connection_lost(exc) else _UNREACHABLE
        )
        reason = first_line.removeprefix("connection failed: ")
        cause = f": {trouble.cause}" if trouble.cause else ""
        error = RegistryUnavailableError(
            f"cannot reach registry {location.display} ({reason}){cause}; {trouble.remedy}"
        )
        error.transient = trouble.transient
        error.remedy = trouble.remedy  # ``ficache.retrying`` keeps it last
        return error
    if "readonly" in lowered or "read-only" in lowered:
        return RegistryReadOnlyError(
            f"registry {location.display} is read-only; pass a writable --db"
        )
    if (
        "locked" in lowered
        or "busy" in lowered
        or "lock timeout" in lowered
        or "deadlock detected" in lowered
        or "could not serialize" in lowered
    ):
        busy = busy_error(location, busy_timeout_ms(engine), waited_s=waited_s, attempts=attempts)
        # A serialization failure or deadlock rolled back one transaction; a plain lock
        # wait is already retried by ``Registry.transaction`` and is not retried again.
        busy.transient = sqlstate in ("40001", "40P01") or "deadlock detected" in lowered
        return busy
    if "not a database" in lowered or "malformed" in lowered:
        return NotARegistryError(
            f"registry {location.display} is corrupt ({message}); restore it or pass another --db"
        )
    if ("disk" in lowered and "full" in lowered) or "no space left" in lowered:
        return RegistryError(
            f"disk full while writing registry {location.display}; free space and retry"
        )
    if "disk i/o error" in lowered:
        # SQLite reports a full disk as an I/O error where it cannot grow its
        # shared-memory file (SQLITE_IOERR_SHMSIZE): WAL needs it to open at all.
        code = getattr(getattr(exc, "orig", None), "sqlite_errorname", None) or "SQLITE_IOERR"
        free = _free_bytes(location.path.parent) if location.path is not None else None
        if free is not None and free < LOW_DISK_BYTES:
            return RegistryError(
                f"disk full while writing registry {location.display}; free space and retry"
            )
        return RegistryError(
            f"disk I/O error on registry {location.display} ({code}); "
            "check the disk and its free space, then retry"
        )
    return RegistryError(f"registry {location.display}: {first_line}")


#: Below this much free space, a SQLite I/O error is reported as a full disk.
LOW_DISK_BYTES = 1 << 20


def _free_bytes(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use in ``directory``'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_revision(
    connection: Connection, location: Location, *, newer_ok: bool = False
) -> str | None:
    """Return the registry's revision; raise if it is foreign or too new.

    A revision this code does not know is too new, unless ``newer_ok`` and
    the registry's ``schema_compat`` row says this code can read it
    (``newer_compat``): then it is returned, and ``write_refusal`` says
    whether this code may also write it.
    """
    if _is_foreign_database(connection):
        raise NotARegistryError(
            f"{location.display} is a database but not a ficache registry; pass another --db"
        )
    revision = current_revision(connection)
    if revision is not None and not _revision_exists(revision):
        compat = stored_compat(connection, revision) if newer_ok else None
        if compat is None or not _revision_exists(compat[0]):
            raise SchemaTooNewError(
                f"registry {location.display} has schema revision {revision!r}, newer than this "
                f"ficache knows (head {head_revision()!r}); upgrade ficache (pip install -U ficache)"
            )
    return revision


def compat_constants(revision: str) -> tuple[str, str]:
    """``(readable_from, writable_from)`` that the installed revision module declares."""
    module = script_directory().get_revision(revision).module
    return str(module.readable_from), str(module.writable_from)


def stored_compat(connection: Connection, revision: str) -> tuple[str, str] | None:
    """``(readable_from, writable_from)`` the registry stores for ``revision``; None: no row.

    A row naming another revision than ``alembic_version`` (a tool that moved
    the revision without ficache) describes nothing and counts as none.
    """
    if COMPAT_TABLE not in inspect(connection).get_table_names():
        return None
    row = connection.execute(
        text(f"SELECT readable_from, writable_from FROM {COMPAT_TABLE} WHERE revision = :r"),
        {"r": revision},
    ).first()
    return None if row is None else (str(row[0]), str(row[1]))


def write_refusal(connection: Connection, location: Location, revision: str | None) -> str | None:
    """Why this code may not write the registry at ``revision`` (None: it may).

    Only a newer revision is refused here: one whose stored ``writable_from``
    is a revision this code does not know.
    """
    if revision is None or _revision_exists(revision):
        return None
    compat = stored_compat(connection, revision)
    if compat is not None and _revision_exists(compat[1]):
        return None
    needs = compat[1] if compat is not None else revision
    return (
        f"registry {location.display} has schema revision {revision!r}, which only ficache "
        f"with schema {needs!r} or newer may write (this one's head is {head_revision()!r}); "
        "upgrade ficache (pip install -U ficache)"
    )


def _stamp_compat(connection: Connection) -> None:
    """Make the ``schema_compat`` row describe the revision the registry is at now."""
    if COMPAT_TABLE not in inspect(connection).get_table_names():
        return
    revision = current_revision(connection)
    connection.execute(text(f"DELETE FROM {COMPAT_TABLE}"))
    if revision is None:
        return
    readable, writable = compat_constants(revision)
    connection.execute(
        text(
            f"INSERT INTO {COMPAT_TABLE} (revision, readable_from, writable_from) "
            "VALUES (:r, :rf, :wf)"
        ),
        {"r": revision, "rf": readable, "wf": writable},
    )


# --------------------------------------------------------------------------
# What an older schema lacks (rolling upgrades: this code on the previous releases' schemas).


@dataclass(frozen=True)
class SchemaFeatures:
    """What one registry's revision holds of what this code's later revisions add.

    Resolved once when a registry opens (``ensure_schema``) from the revision
    modules' ``adds_tables`` and ``adds_columns`` (every revision above the
    registry's, up to this code's head), and attached to its engine
    (``features``), so each query that touches an added table or column asks
    here instead of failing: a missing table reads as empty and is not
    written (``has_table``), a missing column reads as its default
    (``column``, ``columns``) and is left out of writes (``writable``).
    """

    revision: str | None
    #: ``(revision, what it adds in words)`` of each revision this registry lacks, oldest first.
    lacking: tuple[tuple[str, str], ...] = ()
    missing_tables: frozenset[str] = frozenset()
    missing_columns: frozenset[tuple[str, str]] = frozenset()

    @property
    def complete(self) -> bool:
        return not self.lacking

    def has_table(self, name: str) -> bool:
        return name not in self.missing_tables

    def has_column(self, table: str, name: str) -> bool:
        return (table, name) not in self.missing_columns

    def column(self, table: Table, name: str) -> Any:
        """``table``'s column ``name``, or, where this revision lacks it, its default (a
        constant labelled ``name``), as a query selects it."""
        col = table.c[name]
        if self.has_column(table.name, name):
            return col
        default = col.server_default
        value = getattr(default, "arg", None)
        return literal_column(str(getattr(value, "text", value) or "NULL")).label(name)

    def columns(self, table: Table) -> list[Any]:
        """Every column of ``table`` (``column``: a missing one as its default), for ``select``."""
        return [self.column(table, name) for name in table.c.keys()]  # noqa: SIM118 - names, not columns

    def writable(self, table: str, values: dict[str, Any]) -> dict[str, Any]:
        """``values`` without the columns of ``table`` this revision lacks."""
        return {k: v for k, v in values.items() if self.has_column(table, k)}

    def refuse_measurements(self, measurements: Iterable[str]) -> None:
        """Raise ``SchemaTooOldError`` (one line, what to do) when one of ``measurements`` (a
        fingerprint's measurement policy; ``""``: the default) is not the default and this
        revision has no ``fingerprints.measurement``: stored without its policy, such a
        fingerprint would be the default's, its entries mixed in. Plans (dry runs) and
        writes call it alike, so both refuse before anything is written."""
        if self.has_column("fingerprints", "measurement"):
            return
        policy = next((m for m in measurements if m), None)
        if policy is None:
            return
        needs = ", ".join(f"{rev} ({adds})" for rev, adds in self.lacking)
        raise SchemaTooOldError(
            f"the registry is at schema {self.revision!r}, which cannot keep entries tuned "
            f"under measurement policy {policy} apart from the default policy's (needs "
            f"{needs}); nothing written; run `ficache db upgrade` once every ficache that "
            "writes it reads that revision"
        )

    def skipped(self, what: str, location: Location) -> str:
        """The one warning of a write that skipped ``what`` (e.g. "3 protocol records")."""
        needs = ", ".join(f"{rev} ({adds})" for rev, adds in self.lacking)
        return (
            f"registry {location.display} is at schema {self.revision!r}: {what} not stored "
            f"(needs {needs}); run `ficache db upgrade` once every ficache that writes it "
            "reads that revision"
        )


#: An engine execution option: the ``SchemaFeatures`` of the registry it opened.
FEATURES_OPTION = "ficache_schema_features"
#: A registry at this code's head, or newer (newer revisions only add): it lacks nothing.
COMPLETE = SchemaFeatures(None)


def features(conn: Connection | Engine) -> SchemaFeatures:
    """The ``SchemaFeatures`` that ``Registry.open`` attached to ``conn``'s engine; a
    connection of an engine opened otherwise (``db`` commands, migrations) lacks nothing."""
    found = conn.get_execution_options().get(FEATURES_OPTION)
    return found if isinstance(found, SchemaFeatures) else COMPLETE


def attach_features(engine: Engine, found: SchemaFeatures) -> None:
    engine.update_execution_options(**{FEATURES_OPTION: found})


def features_of(revision: str | None) -> SchemaFeatures | None:
    """What a registry at ``revision`` (a revision this code knows) lacks; None: this code
    cannot use it as it is (older than ``oldest_readable``).

    Walks down from head: each revision above ``revision`` must say what it adds
    (``adds_tables``/``adds_columns``, possibly empty); one that does not (it reshapes
    or removes, or predates this rule) is as far down as this code reads.
    """
    if revision is None:
        return None
    head = head_revision()
    if revision == head:
        return COMPLETE
    lacking: list[tuple[str, str]] = []
    tables: set[str] = set()
    columns: set[tuple[str, str]] = set()
    at: str | None = head
    while at != revision:
        if at is None:
            return None
        module = script_directory().get_revision(at).module
        adds_tables = getattr(module, "adds_tables", None)
        adds_columns = getattr(module, "adds_columns", None)
        if adds_tables is None or adds_columns is None:
            return None
        tables.update(adds_tables)
        columns.update((t, c) for t, cols in adds_columns.items() for c in cols)
        lacking.append((at, str(getattr(module, "adds", at))))
        down = script_directory().get_revision(at).down_revision
        at = down if isinstance(down, str) or down is None else None
    return SchemaFeatures(revision, tuple(reversed(lacking)), frozenset(tables), frozenset(columns))


def oldest_readable() -> str:
    """The oldest revision this code reads and writes as it is (``features_of``)."""
    oldest = head_revision()
    for rev, down, _title in reversed(history()):
        if rev == oldest and down is not None and features_of(down) is not None:
            oldest = down
    return oldest


def _older_schema_error(
    location: Location, revision: str | None, *, shared: bool
) -> SchemaTooOldError:
    state = "empty (no schema revision)" if revision is None else f"at schema {revision!r}"
    where = "a shared registry is upgraded only by" if shared else "run"
    return SchemaTooOldError(
        f"registry {location.display} is {state}, older than this ficache "
        f"({head_revision()!r}); {where} `ficache db upgrade`"
    )


@dataclass(frozen=True)
class SchemaCheck:
    """What ``ensure_schema`` found and did."""

    #: Why this code may not write the registry (``write_refusal``), else None.
    refusal: str | None
    #: What the registry's revision lacks of this code's head.
    features: SchemaFeatures
    #: The revision (``"base"``: none) a local file was upgraded from, else None.
    upgraded_from: str | None = None


def ensure_schema(
    engine: Engine,
    location: Location,
    *,
    readonly: bool,
    create: bool = True,
    write: bool = True,
) -> SchemaCheck:
    """Check the registry's schema before use; create or upgrade it where that is allowed.

    Returns what it found (``SchemaCheck``): why this code may not write the
    registry, what its revision lacks (also attached to ``engine``), and the
    revision it upgraded from, if it did.

    - A newer revision is used as its ``schema_compat`` row allows, never touched.
    - An older revision from ``oldest_readable`` on is used as it is, read and
      written, never upgraded: servers of the previous releases may share it.
    - ``write=False`` (a read) never changes the schema: an even older one is
      refused with ``SchemaTooOldError``.
    - A write creates a new registry at head (``create=False`` refuses a
      database without any table). An even older schema is upgraded under the
      lock only in a local SQLite file; a server-backed registry (PostgreSQL)
      is refused, because servers of another ficache share it: only
      ``ficache db upgrade`` (``upgrade``) moves it.
    """
    try:
        with engine.connect() as conn:
            revision = check_revision(conn, location, newer_ok=True)
            empty = revision is None and not inspect(conn).get_table_names()
            if not create and empty:
                raise RegistryError(
                    f"no registry in {location.display}; import a cache file first "
                    "(ficache import FILE)"
                )
            refusal = write_refusal(conn, location, revision)
        if revision is not None and not _revision_exists(revision):
            found: SchemaFeatures | None = COMPLETE  # newer: it only adds to this code's head
        else:
            found = features_of(revision)
        if found is not None:
            if not readonly and refusal is None:
                _enable_wal(engine)
            attach_features(engine, found)
            return SchemaCheck(refusal, found)
        upgraded = _create_or_upgrade(
            engine, location, revision, empty=empty, readonly=readonly, write=write
        )
    except DatabaseError as exc:
        raise translate_operational_error(exc, location, engine=engine) from None
    attach_features(engine, COMPLETE)
    return SchemaCheck(None, COMPLETE, upgraded)


def _create_or_upgrade(
    engine: Engine,
    location: Location,
    revision: str | None,
    *,
    empty: bool,
    readonly: bool,
    write: bool,
) -> str | None:
    """``ensure_schema`` for a registry this code cannot use as it is: a write creates a new
    one at head or, in a local SQLite file only, upgrades an older one under the lock;
    anything else is refused. The revision it upgraded from (None when it created one)."""
    head = head_revision()
    if not write:
        raise _older_schema_error(location, revision, shared=False)
    if readonly:
        state = "empty" if revision is None else f"at revision {revision!r}"
        raise RegistryReadOnlyError(
            f"registry {location.display} is {state}, needs {head!r}, and is read-only; "
            "upgrade it where it is writable (ficache db upgrade)"
        )
    if engine.dialect.name != "sqlite" and not empty:
        raise _older_schema_error(location, revision, shared=True)
    with write_transaction(engine) as conn:
        revision = check_revision(conn, location)  # again, inside the lock
        upgraded = None
        if revision != head:
            _alembic_command().upgrade(alembic_config(conn), "head")
            _stamp_compat(conn)
            upgraded = None if empty else (revision or "base")
    _enable_wal(engine)
    return upgraded


def _enable_wal(engine: Engine) -> None:
    """Put a verified SQLite registry in WAL mode (kept in the file; no-op when it is)."""
    if engine.dialect.name != "sqlite":
        return
    raw = engine.raw_connection()  # outside any transaction, as the pragma needs
    try:
        cursor = raw.cursor()
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.close()
    except engine.dialect.loaded_dbapi.Error:
        pass  # WAL only lets readers and a writer overlap; any journal mode is correct
    finally:
        raw.close()


def _revision_exists(rev: str) -> bool:
    try:
        return script_directory().get_revision(rev) is not None
    except Exception:  # noqa: BLE001 - alembic raises several kinds
        return False


_ANY = object()


def upgrade(
    engine: Engine, location: Location, revision: str = "head", *, expected: object = _ANY
) -> None:
    """Upgrade to ``revision``; ``expected``: the revision a plan was made at (else refused)."""
    if revision not in ("head", "heads") and not _revision_exists(revision):
        raise SchemaError(f"unknown revision {revision!r}; see ficache db history")
    try:
        with write_transaction(engine) as conn:
            current = check_revision(conn, location)
            if expected is not _ANY and current != expected:
                raise ConflictError(
                    f"registry {location.display} moved to revision {current!r} since the "
                    f"upgrade was planned at {expected!r}; plan it again"
                )
            _alembic_command().upgrade(alembic_config(conn), revision)
            _stamp_compat(conn)
    except (OperationalError, DatabaseError) as exc:
        raise translate_operational_error(exc, location, engine=engine) from None


#: The first revision whose code reads ``schema_compat`` (older code refuses any newer schema).
COMPAT_REVISION = "0007_compat"


def _order(revision: str) -> int:
    return [rev for rev, _down, _title in history()].index(revision)


def release_of(revision: str) -> str:
    """The ficache release whose schema head ``revision`` is, as its title names it."""
    title = next(t for rev, _down, t in history() if rev == revision)
    name = title.split(":", 1)[0]
    return name if name.startswith("ficache ") else f"ficache at {revision}"


def release_access(head: str, revision: str) -> tuple[bool, bool]:
    """``(reads, writes)``: whether the release whose schema head is ``head`` (a revision
    this code knows) uses a registry at ``revision`` as it is.

    Older code than the registry decides by the registry's ``schema_compat`` row (from
    ``COMPAT_REVISION`` on); this release by ``features_of``; a release between the two
    (older than this one, newer than the registry) refused or upgraded older schemas.
    """
    if head == revision:
        return True, True
    if _order(head) < _order(revision):
        if _order(head) < _order(COMPAT_REVISION):
            return False, False
        readable, writable = compat_constants(revision)
        return _order(head) >= _order(readable), _order(head) >= _order(writable)
    usable = head == head_revision() and features_of(revision) is not None
    return usable, usable


@dataclass(frozen=True)
class RevisionInfo:
    """One schema revision as ``ficache db history`` shows it: the release it is the head
    of (as ``--version`` numbers it), and the releases that use a registry at it as it is,
    reading (``read_by``) and writing (``written_by``) (``release_access``)."""

    revision: str
    down: str | None
    release: str
    title: str
    read_by: tuple[str, ...]
    written_by: tuple[str, ...]

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "read_by": list(self.read_by), "written_by": list(self.written_by)}


def revision_table() -> list[RevisionInfo]:
    """Every revision this code knows, oldest first, with who reads and writes it."""
    rows = history()
    heads = [rev for rev, _down, _title in rows]

    def number(head: str) -> str:
        return release_of(head).removeprefix("ficache ")

    table = []
    for rev, down, title in rows:
        access = [(head, release_access(head, rev)) for head in heads]
        table.append(
            RevisionInfo(
                rev,
                down,
                number(rev),
                title.split(": ", 1)[1] if title.startswith("ficache ") else title,
                tuple(number(head) for head, (reads, _w) in access if reads),
                tuple(number(head) for head, (_r, writes) in access if writes),
            )
        )
    return table


@dataclass(frozen=True)
class UpgradePlan:
    """What ``ficache db upgrade`` would do to one registry: the revisions it applies, and
    which ficache releases then stop reading or writing it (named by their schema heads).

    ``shared``: a server-backed registry (PostgreSQL), which servers of other releases
    may use: the CLI asks before it stops any of them. ``execute`` applies the plan only
    while the registry is still at ``current``.
    """

    location: Location
    current: str | None
    target: str
    steps: tuple[tuple[str, str], ...]  # (revision, title), oldest first
    stop_writing: tuple[str, ...]  # schema heads of releases that write it now, not after
    stop_reading: tuple[str, ...]  # of those, the ones that also stop reading it
    shared: bool

    @property
    def asks(self) -> bool:
        """Whether the upgrade stops a release that may share the registry from using it."""
        return self.shared and bool(self.stop_writing)

    def execute(self, engine: Engine) -> None:
        upgrade(engine, self.location, self.target, expected=self.current)


def plan_upgrade(engine: Engine, location: Location, revision: str = "head") -> UpgradePlan:
    """The revisions from the registry's up to ``revision``, and whom they stop."""
    target = head_revision() if revision in ("head", "heads") else revision
    if not _revision_exists(target):
        raise SchemaError(f"unknown revision {revision!r}; see ficache db history")
    try:
        with engine.connect() as conn:
            current = check_revision(conn, location)
            empty = current is None and not inspect(conn).get_table_names()
    except DatabaseError as exc:
        raise translate_operational_error(exc, location, engine=engine) from None
    order = [rev for rev, _down, _title in history()]
    titles = {rev: title for rev, _down, title in history()}
    start = 0 if current is None else order.index(current) + 1
    if current is not None and order.index(target) < start - 1:
        raise SchemaError(
            f"revision {target!r} is below the registry's revision {current!r}; "
            "use ficache db downgrade"
        )
    steps = tuple((rev, titles[rev]) for rev in order[start : order.index(target) + 1])
    stop_writing: list[str] = []
    stop_reading: list[str] = []
    if current is not None and steps:
        for head in order[: order.index(target) + 1]:
            reads_now, writes_now = release_access(head, current)
            reads_after, writes_after = release_access(head, target)
            if writes_now and not writes_after:
                stop_writing.append(head)
            if reads_now and not reads_after:
                stop_reading.append(head)
    shared = engine.dialect.name != "sqlite" and not empty
    return UpgradePlan(
        location, current, target, steps, tuple(stop_writing), tuple(stop_reading), shared
    )


def upgrade_sql(plan: UpgradePlan, dialect: str) -> str:
    """The SQL ``plan`` runs, as Alembic's offline mode writes it (``db upgrade --sql``),
    with the ``schema_compat`` row it leaves; nothing is connected to or changed."""
    import io

    from alembic.config import Config

    buffer = io.StringIO()
    config = Config(output_buffer=buffer)
    for option, value in alembic_config().get_section(config.config_ini_section, {}).items():
        config.set_main_option(option, value)
    config.attributes["offline_dialect"] = dialect
    start = plan.current or "base"
    _alembic_command().upgrade(config, f"{start}:{plan.target}", sql=True)
    sql = buffer.getvalue()
    if dialect == "postgresql":  # queue behind ficache's writers, as `db upgrade` does
        lock = f"SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK_ID});\n\n"
        sql = sql.replace("BEGIN;\n\n", "BEGIN;\n\n" + lock, 1)
    if _order(plan.target) >= _order(COMPAT_REVISION):
        readable, writable = compat_constants(plan.target)
        compat = (
            "-- ficache: which older ficache may read and write this revision\n\n"
            f"DELETE FROM {COMPAT_TABLE};\n\n"
            f"INSERT INTO {COMPAT_TABLE} (revision, readable_from, writable_from) "
            f"VALUES ('{plan.target}', '{readable}', '{writable}');\n\n"
        )
        at = sql.rfind("COMMIT;")
        sql = sql[:at] + compat + sql[at:]
    return sql


@dataclass(frozen=True)
class DowngradeStep:
    """Undoing one revision: ``revision`` to ``down_revision``, and what that loses."""

    revision: str
    down_revision: str | None
    lost: tuple[str, ...]  # what the registry holds that this step drops, with counts

    @property
    def lost_str(self) -> str:
        return "; ".join(self.lost) if self.lost else "keeps every stored value"


@dataclass(frozen=True)
class DowngradePlan:
    """What ``ficache db downgrade`` would do to one registry: each step, and what it loses.

    Counted from the registry itself when planned; ``execute`` applies it only
    while the registry is still at ``current``.
    """

    location: Location
    current: str | None
    target: str
    steps: tuple[DowngradeStep, ...]

    @property
    def loses_data(self) -> bool:
        return any(step.lost for step in self.steps)

    def execute(self, engine: Engine) -> None:
        downgrade(engine, self.location, self.target, expected=self.current)


def plan_downgrade(engine: Engine, location: Location, revision: str) -> DowngradePlan:
    """The steps from the registry's revision down to ``revision`` (or ``base``), counted."""
    if revision != "base" and not _revision_exists(revision):
        raise SchemaError(f"unknown revision {revision!r}; see ficache db history")
    target = None if revision == "base" else revision
    try:
        with engine.connect() as conn:
            current = check_revision(conn, location)
            steps = []
            at = current
            while at != target:
                if at is None:
                    raise SchemaError(
                        f"revision {revision!r} is not below the registry's revision "
                        f"{current!r}; see ficache db current"
                    )
                script = script_directory().get_revision(at)
                down = script.down_revision
                assert down is None or isinstance(down, str), "ficache's revisions are linear"
                lost = tuple(getattr(script.module, "lost_on_downgrade", lambda _c: [])(conn))
                steps.append(DowngradeStep(at, down, lost))
                at = down
    except DatabaseError as exc:
        raise translate_operational_error(exc, location, engine=engine) from None
    return DowngradePlan(location, current, revision, tuple(steps))


def downgrade(
    engine: Engine, location: Location, revision: str, *, expected: object = _ANY
) -> None:
    """Downgrade to ``revision``; ``expected``: the revision a plan was made at (else refused)."""
    if revision != "base" and not _revision_exists(revision):
        raise SchemaError(f"unknown revision {revision!r}; see ficache db history")
    try:
        with write_transaction(engine) as conn:
            current = check_revision(conn, location)
            if expected is not _ANY and current != expected:
                raise ConflictError(
                    f"registry {location.display} moved to revision {current!r} since the "
                    f"downgrade was planned at {expected!r}; plan it again"
                )
            _alembic_command().downgrade(alembic_config(conn), revision)
            _stamp_compat(conn)
    except (OperationalError, DatabaseError) as exc:
        raise translate_operational_error(exc, location, engine=engine) from None


def history() -> list[tuple[str, str | None, str]]:
    """``(revision, down_revision, title)`` from base to head."""
    rows = []
    for script in reversed(list(script_directory().walk_revisions())):
        title = (script.doc or "").strip().splitlines()[0] if script.doc else ""
        down = (
            script.down_revision
            if isinstance(script.down_revision, str) or script.down_revision is None
            else ",".join(script.down_revision)
        )
        rows.append((script.revision, down, title))
    return rows
