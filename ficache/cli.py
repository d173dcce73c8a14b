"""The ``ficache`` command line: a thin layer over the library.

Invariants:
- Each command opens the registry (a ``db`` command its schema:
  ``ficache.registry_schema``), calls the library, prints. Decisions (what to
  prune, what an export holds) are made in the library.
- Exit codes: 0 success, 1 error (one line on stderr, ``error: ...``; the
  traceback only with ``--debug``), 2 usage (click's own).
- Destructive commands (``prune``, ``revert``, ``db downgrade``) build a plan,
  print it, stop on ``--dry-run``, ask unless ``--yes``, then execute.
- Read-only commands never create a registry. A write that creates a new
  SQLite registry says "note: creating a new registry at PATH" once on stderr; a command
  that fails before any commit removes the registry (and directories) it created.
- ``--db`` is taken before the subcommand and, on every command that opens
  a registry (``pass_ctx``), after it too; there it wins.
- A commit made is reported as made: once a command's registry made a commit
  (``Registry.commit_listeners``), a Ctrl-C no longer stops it with
  "interrupted" and exit 130; it finishes, prints its report, notes the
  interrupt on stderr and exits as it would have. SIGTERM is a Ctrl-C, and
  so is either at a confirmation prompt (exit 130, not click's 1).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from ficache import __version__, values
from ficache.errors import FicacheError, SchemaTooOldError

T = TypeVar("T")
CommandT = TypeVar("CommandT", bound=Callable[..., Any])

#: A commit id or row count as the CLI takes it: positive, and at most the largest
#: integer SQLite stores (``ficache.registry.MAX_ROW_ID``; a larger one cannot be bound).
POSITIVE_ID = click.IntRange(min=1, max=2**63 - 1)

FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Output as an aligned table or as JSON.",
)

#: ``ficache.merge.POLICIES`` (merge's and import's ``--on-conflict``), repeated so
#: that `--help` does not import the library.
MERGE_POLICIES = ("keep", "theirs", "newest", "vote", "drop", "fail")


def on_conflict_option(
    conflict: str, *, keep: str, theirs: str, vote: str, drop: str, fail: str
) -> Callable[[CommandT], CommandT]:
    """``--on-conflict`` (``MERGE_POLICIES``, default keep), as ``import`` and ``merge`` take it:
    one option, whose help names what ``keep``, ``theirs``, ``vote``, ``drop`` and ``fail``
    mean for the command's ``conflict``."""
    return click.option(
        "--on-conflict",
        "policy",
        type=click.Choice(MERGE_POLICIES),
        default="keep",
        show_default=True,
        help=f"Which value wins {conflict}: {keep} (keep), {theirs} (theirs), the most "
        f"recently tuned (newest), {vote} (vote); or {drop} (drop), or {fail} (fail).",
    )


def _upgraded_note(location: Any, revision: str) -> str:
    """The note of a write that upgraded a local SQLite file older than this ficache reads."""
    from ficache import schema

    return (
        f"note: upgraded registry {location.display} from schema {revision!r} to "
        f"{schema.head_revision()!r} (a local file older than {schema.oldest_readable()!r}, "
        "which this ficache cannot use as it is)"
    )


def _say_skipped(warning: str) -> None:
    """A write left out what the registry's older schema cannot hold: one line on stderr."""
    click.echo(f"warning: {warning}", err=True)


class _Context:
    def __init__(self, db: str | None, debug: bool) -> None:
        self.db = db
        self.debug = debug

        #: Commits this command made (``Registry.commit_listeners``): once one is
        #: made, a Ctrl-C no longer turns the command into a failure.
        self.commits: list[int] = []
        #: SQLite files this command created, with the directories created for them
        #: (outermost first): a command that fails before any commit removes them.
        self.created: list[tuple[Path, list[Path]]] = []

    def registry(self, *, create: bool = True, write: bool = True) -> Any:
        """The registry, opened to write (its schema may be upgraded) or, ``write=False``, to read."""
        from ficache import schema
        from ficache.registry import Registry

        path = schema.resolve(self.db).path if create else None
        new_dirs = _missing_parents(path) if path is not None else []
        reg = Registry.open(self.db, create=create, write=write)
        if reg.created:
            self.note_created(reg.location, new_dirs)
        reg.commit_listeners.append(self._made)
        reg.skip_listeners.append(_say_skipped)
        if reg.upgraded_from is not None:
            click.echo(_upgraded_note(reg.location, reg.upgraded_from), err=True)
        return reg

    def registry_schema(self, *, create: bool) -> Any:
        """The registry's schema, opened for a ``db`` command (``ficache.registry_schema``)."""
        from ficache import schema
        from ficache.registry_schema import RegistrySchema

        path = schema.resolve(self.db).path if create else None
        new_dirs = _missing_parents(path) if path is not None else []
        target = RegistrySchema.open(self.db, create=create)
        if target.created:
            self.note_created(target.location, new_dirs)
        return target

    def note_created(self, location: Any, new_dirs: list[Path]) -> None:
        """Say (once, on stderr) that this command created the SQLite registry at ``location``."""
        _say_created(location)
        self.created.append((location.path, new_dirs))

    def discard_created(self) -> None:
        """Remove the registries this failed command created, when it committed nothing.

        A mistyped ``--db`` and a command that then failed leaves no empty
        registry (nor directories) behind: the state is as before the command.
        """
        if self.commits:
            return
        for path, new_dirs in self.created:
            for name in (path, *(path.with_name(path.name + s) for s in SQLITE_SIDE_FILES)):
                with contextlib.suppress(FileNotFoundError):
                    name.unlink()
            for directory in reversed(new_dirs):
                with contextlib.suppress(OSError):  # not empty: something else is in it
                    directory.rmdir()
        self.created.clear()

    def _made(self, commit_id: int) -> None:
        self.commits.append(commit_id)
        pause = os.environ.get(PAUSE_AFTER_COMMIT_ENV)
        if pause:
            _pause_after_commit(Path(pause), commit_id)


#: The files SQLite keeps beside a database (``PATH-wal`` ...).
SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")


def _missing_parents(path: Path) -> list[Path]:
    """The directories above ``path`` that do not exist yet, outermost first."""
    missing: list[Path] = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    return missing[::-1]


def _say_created(location: Any) -> None:
    """One line on stderr when a command creates a new SQLite registry (a mistyped --db)."""
    click.echo(f"note: creating a new registry at {location.display}", err=True)


#: Test hook: a file path. After each commit (SIGINT held) the CLI writes the commit
#: id there and waits, at most 30 s, for a SIGINT to arrive (tests/test_cli.py).
PAUSE_AFTER_COMMIT_ENV = "FICACHE_TEST_PAUSE_AFTER_COMMIT"


def _pause_after_commit(path: Path, commit_id: int) -> None:
    from ficache._interrupts import interrupt_pending

    path.write_text(str(commit_id))
    deadline = time.monotonic() + 30
    while not interrupt_pending() and time.monotonic() < deadline:
        time.sleep(0.01)


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


class _Group(click.Group):
    """Maps library errors to one line and exit code 1."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        given = list(args)  # the command line as given, for _first_non_utf8
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta.setdefault(_ARGV_META, given)
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        interrupted_after: list[int] = []
        with _interrupts_after_commits_ignored(ctx, interrupted_after):
            try:
                result = self._invoke(ctx)
            except BaseException as exc:
                failed = not isinstance(exc, (SystemExit, click.exceptions.Exit)) or (
                    getattr(exc, "code", getattr(exc, "exit_code", 1)) not in (0, None)
                )
                obj = ctx.find_object(_Context)
                if failed and obj is not None:
                    obj.discard_created()
                raise
            finally:
                if interrupted_after:
                    click.echo(
                        f"interrupted after commit {interrupted_after[-1]} was made; "
                        "the commit stands",
                        err=True,
                    )
        return result

    def _invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FicacheError as exc:
            if _debug(ctx):
                raise
            _fail(str(exc))
        except click.Abort as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                # Ctrl-C (or SIGTERM) at a prompt: click turns it into Abort (exit 1).
                click.echo("\ninterrupted", err=True)
                sys.exit(130)
            raise
        except (click.exceptions.Exit, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:
            # The reader (`| head`) went away: stop quietly, as Unix tools do.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except Exception as exc:  # noqa: BLE001 - the last line of defence
            if _debug(ctx):
                raise
            not_utf8 = _first_non_utf8(ctx.meta.get(_ARGV_META, ()))
            if isinstance(exc, UnicodeEncodeError) and not_utf8 is not None:
                # Bytes that are not UTF-8 reached SQLite, which stores text as UTF-8.
                _fail(
                    f"argument {ascii(not_utf8)} is not valid UTF-8, and ficache stores "
                    "names, keys and paths as UTF-8; pass it in UTF-8"
                )
            _fail(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)")


_ARGV_META = "ficache.argv"
#: The signals that stop a command: Ctrl-C, and SIGTERM as a service manager sends it.
_STOP_SIGNALS = ("SIGINT", "SIGTERM")


@contextlib.contextmanager
def _interrupts_after_commits_ignored(ctx: click.Context, noted: list[int]) -> Iterator[None]:
    """While the command runs, a Ctrl-C (or SIGTERM) once it made a commit is noted, not raised.

    Before any commit a Ctrl-C or SIGTERM stops the command as ever
    ("interrupted", exit 130, a registry it created removed). After one, the
    registry already holds the result, so the command finishes and reports it;
    the commit id goes to ``noted``.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigint(signum: int, frame: Any) -> None:
        obj = ctx.obj
        if isinstance(obj, _Context) and obj.commits:
            noted.append(obj.commits[-1])
            return
        raise KeyboardInterrupt

    # SIGTERM (a service manager, ``kill``) stops a command as Ctrl-C does.
    previous = {
        signum: signal.signal(signum, on_sigint)
        for signum in (getattr(signal, name) for name in _STOP_SIGNALS)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python; leave it
                signal.signal(signum, handler)


def _first_non_utf8(args: Sequence[str]) -> str | None:
    """The first argument holding bytes that are not UTF-8 (as surrogate escapes)."""
    for arg in args:
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            return arg
    return None


def _debug(ctx: click.Context) -> bool:
    obj = ctx.find_object(_Context)
    return bool(obj and obj.debug) or "--debug" in sys.argv


_pass_context = click.make_pass_decorator(_Context)

#: ``--db``'s help, before the subcommand and after it.
_DB_HELP = (
    "Registry: a SQLite path or SQLAlchemy URL [env FICACHE_DB; default: the user cache dir]."
)


def _db_after_subcommand(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
    """Click callback: ``--db`` given after the subcommand replaces the one before it."""
    obj = ctx.find_object(_Context)  # made by ``cli`` before any subcommand's options
    if value is not None and obj is not None:
        obj.db = value


def pass_ctx(command: Any) -> Any:
    """Pass the command's ``_Context``; and take ``--db`` after the subcommand too.

    Every command that opens a registry takes the context, so each of them
    accepts ``ficache list --db X`` as well as ``ficache --db X list``. Given
    in both places, the one after the subcommand wins (it is the later on
    the command line, as a repeated option's last value does); FICACHE_DB
    applies only where ``--db`` is given in neither.
    """
    return click.option(
        "--db",
        "db_after_subcommand",
        metavar="PATH_OR_URL",
        expose_value=False,
        callback=_db_after_subcommand,
        help=_DB_HELP,
    )(_pass_context(command))


def _printable(text: str) -> str:
    """``text`` with each character a terminal would act on (ESC, CR, BEL, ...) escaped as
    Python writes it (``\\x1b``): stored strings come from files and are shown, never obeyed."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = [[str(h) for h in headers]] if any(headers) else []  # all-empty headers: no header line
    cells = head + [["" if v is None else _printable(str(v)) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _served(ts: float | None) -> str:
    """When a warm start last served a fingerprint (``never`` for NULL)."""
    return "never" if ts is None else _when(ts)


def _dump_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


#: Age units ``--older-than`` / ``--unused-for`` take. A bare ``m`` is refused: it
#: reads as minutes to some and months to others (``min`` or ``mo``); a month is 30
#: days and a year 365.
_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*$")
_AGE_SECONDS = {
    "s": 1,
    "min": 60,
    "h": 3600,
    "d": 86400,
    "w": 7 * 86400,
    "mo": 30 * 86400,
    "y": 365 * 86400,
}


class AgeType(click.ParamType):
    name = "AGE"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        m = _AGE.match(str(value))
        if m and m.group(2) == "m":
            self.fail(
                f"{value!r} is ambiguous: write {m.group(1)}min for minutes or "
                f"{m.group(1)}mo for months",
                param,
                ctx,
            )
        if not m or m.group(2) not in _AGE_SECONDS:
            self.fail(
                f"{value!r} is not an age like 30d, 12h, 90min, 2w, 6mo, 1y "
                "(units: s, min, h, d, w, mo, y)",
                param,
                ctx,
            )
        return float(m.group(1)) * _AGE_SECONDS[m.group(2)]


def _check_scope(_ctx: click.Context, _param: click.Parameter, value: str | None) -> str | None:
    """Click callback: a scope is 'shared' or '<layout>/rank<N>'."""
    from ficache.registry import validate_scope

    if value is None:
        return None
    try:
        return validate_scope(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _resolve_fingerprint(reg: Any, ref: str) -> Any:
    """A stored fingerprint by id/digest, or ``current`` (collected now)."""
    if ref == "current":
        from ficache.fingerprint import collect

        return collect()
    return reg.fingerprint(ref).fingerprint


def _confirm_or_stop(question: str, *, dry_run: bool, yes: bool, err: bool = False) -> None:
    """Stop on ``dry_run``, go on with ``yes``, else ask; ``err``: talk on stderr
    (stdout carries JSON)."""
    if dry_run:
        click.echo("dry run: nothing changed", err=err)
        sys.exit(0)
    if yes:
        return
    if not sys.stdin.isatty():
        _fail("refusing to change the registry without confirmation; pass --yes")
    if not click.confirm(question, default=False, err=err):
        click.echo("aborted: nothing changed", err=err)
        sys.exit(1)


#: Reading at least this many sources shows a progress bar (on a terminal only).
PROGRESS_MIN_SOURCES = 4


@contextlib.contextmanager
def _progress(items: Sequence[T], label: str) -> Iterator[Iterable[T]]:
    """``items``, with a progress bar on stderr when it is a terminal and they are many.

    Piped or captured output never shows it, so scripts see clean streams.
    """
    if len(items) < PROGRESS_MIN_SOURCES or not sys.stderr.isatty():
        yield items
        return
    with click.progressbar(items, label=label, file=sys.stderr) as bar:
        yield bar


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar="FICACHE_DB",
    metavar="PATH_OR_URL",
    help=_DB_HELP,
)
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.version_option(__version__, prog_name="ficache")
@click.pass_context
def cli(ctx: click.Context, db: str | None, debug: bool) -> None:
    """Inspect, ship, merge and clean FlashInfer autotuning caches."""
    ctx.obj = _Context(db, debug)
    if debug:
        import logging

        logging.basicConfig(level=logging.DEBUG)


# -- fingerprints ------------------------------------------------------------


@cli.command("fingerprint")
@FORMAT
def fingerprint_cmd(fmt: str) -> None:
    """Print the fingerprint of this environment (imports FlashInfer)."""
    from ficache.fingerprint import collect

    fp = collect()
    if fmt == "json":
        _dump_json({"digest": fp.digest, **fp.as_dict()})
    else:
        click.echo(_table(["field", "value"], [("digest", fp.digest), *fp.as_dict().items()]))


@cli.command("fingerprints")
@click.option("--gpu", help="Only fingerprints with this GPU name.")
@click.option("--flashinfer-version", help="Only fingerprints with this FlashInfer version.")
@click.option(
    "--all",
    "include_empty",
    is_flag=True,
    help="Also fingerprints that hold no entries and no records (pruned to nothing).",
)
@click.option("--wide", is_flag=True, help="Show every field and the digest (a wide table).")
@click.option(
    "--here",
    is_flag=True,
    help="Mark the fingerprint that serves this environment and those that fill in keys it "
    "lacks (reads the environment: imports torch and FlashInfer).",
)
@FORMAT
@pass_ctx
def fingerprints_cmd(
    obj: _Context,
    gpu: str | None,
    flashinfer_version: str | None,
    include_empty: bool,
    wide: bool,
    here: bool,
    fmt: str,
) -> None:
    """List stored fingerprints with their entry and record counts and when a start last served each.

    The table shows the fields that tell fingerprints apart; --wide or
    --format json gives every field. A missing field (the file's _metadata
    lacked it) shows as `-` (null in JSON) and is left out of exports.

    When several match one environment, the one with the most exact fields
    (fewest `*`), then the newest, serves it; the others fill in only keys
    it lacks. `--here` marks them for this environment; `ficache fold`
    merges one into another.
    """
    from ficache.catalog import fingerprint_listing

    current = None
    if here:
        from ficache.fingerprint import collect

        current = collect()
    field_filters = {"gpu": gpu, "flashinfer_version": flashinfer_version}
    with obj.registry(create=False, write=False) as reg:
        listing = fingerprint_listing(
            reg, filters=field_filters, include_empty=include_empty, here=current
        )
    notes = _filter_miss_notes(listing.misses, None)
    if fmt == "json":
        _dump_json([s.as_json() for s in listing.shown])
    else:
        click.echo(_fingerprints_table(listing.shown, wide=wide, here=here))
    if listing.hidden_empty:
        notes.append(
            f"note: {listing.hidden_empty} fingerprint(s) without entries or records not shown; "
            "--all shows them"
        )
    for note in notes:
        click.echo(note, err=True)


#: ``fingerprints``'s default field columns: (header, field); counts and times follow.
_FINGERPRINT_COLUMNS = (
    ("gpu", "gpu"),
    ("cc", "compute_capability"),
    ("flashinfer", "flashinfer_version"),
    ("torch", "torch_version"),
    ("cuda", "cuda_version"),
)
#: The longest field value the default table shows whole (then cut, ending in "...").
_FINGERPRINT_CELL = 24


def _fingerprints_table(summaries: Sequence[Any], *, wide: bool, here: bool = False) -> str:
    """The table of ``fingerprints``: the telling fields (about 100 columns), or all with ``wide``."""
    from ficache.fingerprint import ALL_FIELDS, shown

    def cell(value: str) -> str:
        value = shown(value)
        if wide or len(value) <= _FINGERPRINT_CELL:
            return value
        return value[: _FINGERPRINT_CELL - 3] + "..."

    if wide:
        headers = ["id", "entries", "records", "last served", "digest", *ALL_FIELDS]
        fields: Sequence[str] = ALL_FIELDS
    else:
        headers = ["id", *(h for h, _ in _FINGERPRINT_COLUMNS), "entries", "records", "last served"]
        fields = [f for _, f in _FINGERPRINT_COLUMNS]
    # A column of its own only where a fingerprint is under a non-default measurement
    # policy (two rows of the same fields are told apart by it).
    measured = any(s.info.fingerprint.measurement for s in summaries)
    if measured:
        from ficache.v2_store import measurement_label

        headers.append("measurement")
    rows = []
    for s in summaries:
        values = [cell(getattr(s.info.fingerprint, f)) for f in fields]
        counts = [s.info.entries, s.records, _served(s.info.last_served_at)]
        if wide:
            row = [s.info.id, *counts, s.info.fingerprint.short_digest, *values]
        else:
            row = [s.info.id, *values, *counts]
        if measured:
            row.append(measurement_label(s.info.fingerprint.measurement_fields))
        if here:
            row.append(s.here or "")
        rows.append(row)
    return _table([*headers, "here"] if here else headers, rows)


# -- import / export -----------------------------------------------------------


#: ``ficache import``'s help text (``import_cmd``).
IMPORT_HELP = """Import FlashInfer autotune cache files, or ficache bundles, all of them as one commit.

Every file is read and validated first: one invalid file imports nothing.
A bundle (from `export --bundle`) is recognised by its content and keeps
its own fingerprints, scopes and tuning times. A FILE of `-` is standard
input; a pipe (`<(cat f.json)`, /dev/stdin) is read once, as a file.

A key two inputs hold is imported once: a duplicate when they agree, a
conflict settled by --on-conflict (merge's rule) when they do not. The
summary counts every input entry once: added, replaced, unchanged,
duplicates, conflicts. --dry-run prints it and changes nothing.

A directory is a FlashInfer v2 store (`autotune_v2`): its root, or one
environment directory under root/v2/. Every environment is imported with
its fingerprint and measurement policy; malformed entries are skipped and
counted, as FlashInfer treats them as misses; protocol records (FlashInfer
0.7.4+) are stored as protocol records, shared, apart from _records.

--from-vllm adopts what vLLM already tuned: its autotune files (one per
deployment in vLLM 0.27-0.31, one per rank since 0.32) and its v2 store.
Entries and namespaced records (_records) equal on every rank of a
deployment are stored shared, the rest scoped to their rank; unreadable
files are skipped and counted.

--from-sglang adopts SGLang's own per-rank files (runs/ included), each TP
group of a deployment (one pipeline stage, one data-parallel replica) as
one layout, by the same rule; files whose _metadata says "unknown", temp
files and symlinks that leave ROOT are skipped and counted.
"""


@cli.command("import", help=IMPORT_HELP)
@click.argument("files", nargs=-1, type=click.Path(path_type=Path))
@click.option(
    "--fingerprint",
    "fingerprint_ref",
    metavar="ID|current",
    help="Fingerprint for files without _metadata (a stored id or `current`).",
)
@click.option(
    "--scope",
    callback=_check_scope,
    default="shared",
    show_default=True,
    help="Rank scope of the entries: 'shared' or '<layout>/rank<N>'.",
)
@click.option(
    "--from-vllm",
    "from_vllm",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ROOT]",
    help="Adopt vLLM's own FlashInfer autotune caches (vLLM 0.27-0.33) under ROOT "
    "[default: VLLM_CACHE_ROOT or ~/.cache/vllm, VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR, "
    "FlashInfer's v2 store].",
)
@click.option(
    "--from-sglang",
    "from_sglang",
    is_flag=False,
    flag_value="",
    default=None,
    metavar="[ROOT]",
    help="Adopt SGLang's own FlashInfer autotune files (SGLang 0.5.23) under ROOT "
    "[default: SGLANG_CACHE_DIR or ~/.cache/sglang].",
)
@click.option(
    "--layout",
    metavar="NAME",
    help="With --from-vllm: the layout that per-rank files are scoped to, as the vLLM "
    "plugin names it (tp4-pp1-dp1-ep4) [default: tp<files>-pp1-dp<D>-ep1]. With "
    "--from-sglang: the sizes of every deployment found, in the same form; each TP "
    "group's layout adds its stage and replica (tp4-pp1-dp1-ep4.pp0.dp0).",
)
@on_conflict_option(
    "when two FILES hold one key with different values, as in merge",
    keep="the first file's",
    theirs="the last's",
    vote="the most files'",
    drop="import none of them",
    fail="import nothing and exit 1",
)
@click.option("--dry-run", is_flag=True, help="Show what the import would do and change nothing.")
@FORMAT
@pass_ctx
def import_cmd(
    obj: _Context,
    files: tuple[Path, ...],
    fingerprint_ref: str | None,
    scope: str,
    from_vllm: str | None,
    from_sglang: str | None,
    layout: str | None,
    policy: str,
    dry_run: bool,
    fmt: str,
) -> None:
    """``ficache import``: parse, prepare the request's kind of import, run it, render it.

    Its help text is ``IMPORT_HELP`` (too long for a docstring of a short function).
    """
    from ficache import import_request as ir
    from ficache import ingest

    with ingest.spooled(files) as spool:  # a pipe or `-` is read once, here
        request = ir.ImportRequest(
            spool.paths,
            fingerprint_ref,
            scope,
            from_vllm,
            from_sglang,
            layout,
            policy,
            tuple(spool.names.items()),
        )
        _import_request(obj, request, dry_run, fmt)


def _import_request(obj: _Context, request: Any, dry_run: bool, fmt: str) -> None:
    """``import`` of a decided request: an adoption, v2 stores, bundles or FlashInfer files."""
    from ficache import import_request as ir
    from ficache import ingest

    with _import_usage():
        kind = request.kind()
        adoption = ir.prepare_adoption(request) if kind == ir.ADOPTION else None
    if adoption is not None:
        _import_from_vllm(obj, adoption, dry_run, fmt)
        return
    if kind == ingest.V2_STORE:
        _import_v2_stores(obj, ir.prepare_store_import(request), dry_run, fmt)
        return
    if kind == ingest.BUNDLE:
        _run_import(obj, fmt, ir.prepare_bundle_import(request), "bundle", dry_run)
        return
    _import_files(obj, request, dry_run, fmt)


def _import_files(obj: _Context, request: Any, dry_run: bool, fmt: str) -> None:
    """``import`` of FlashInfer files: read them (with progress), plan, preview or execute,
    report, then the notes and warnings of the reading."""
    from ficache import import_request as ir

    with _import_usage(), _progress(request.files, "reading files") as items:
        read = ir.read_file_import(request, items)
    prepared = read.early_plan()
    with _import_registry(obj, dry_run) as reg:
        if prepared is None:
            prepared = read.plan_in(reg, obj.db or "the default path")
        result = prepared.preview(reg) if dry_run else prepared.execute(reg)
        if dry_run and result.skipped:  # what the real run leaves out
            _say_skipped(result.skipped)
    _report_import(fmt, prepared.plan, result, "file", dry_run=dry_run)
    if read.note:
        click.echo(read.note, err=True)
    ignored = read.ignored_selections
    if ignored:
        click.echo(
            f"warning: {ignored} entr{'y' if ignored == 1 else 'ies'} held a fourth element that "
            "is not an object; imported without a selection, as FlashInfer ignores it",
            err=True,
        )
    if read.unreadable_keys:
        from ficache.flashinfer_format import unreadable_note

        click.echo(f"warning: {unreadable_note(read.unreadable_keys)}", err=True)


@contextlib.contextmanager
def _import_usage() -> Iterator[None]:
    """An ``import_request.ImportUsageError`` as click's usage error (exit 2)."""
    from ficache.import_request import ImportUsageError

    try:
        yield
    except ImportUsageError as exc:
        if exc.param_hint is not None:
            raise click.BadParameter(str(exc), param_hint=exc.param_hint) from None
        raise click.UsageError(str(exc)) from None


def _run_import(obj: _Context, fmt: str, prepared: Any, source_noun: str, dry_run: bool) -> None:
    """Preview (``dry_run``) or execute one prepared import, and report it."""
    with _import_registry(obj, dry_run) as reg:
        result = prepared.preview(reg) if dry_run else prepared.execute(reg)
        if dry_run and result.skipped:  # what the real run leaves out
            _say_skipped(result.skipped)
    _report_import(fmt, prepared.plan, result, source_noun, dry_run=dry_run)


@contextlib.contextmanager
def _import_registry(obj: _Context, dry_run: bool) -> Iterator[Any]:
    """The registry an import writes; with ``dry_run``, opened to read only, or None
    where no registry exists yet (a dry run creates none)."""
    from ficache import schema

    if not dry_run:
        with obj.registry() as reg:
            yield reg
        return
    location = schema.resolve(obj.db)
    if location.path is not None and not location.path.exists():
        yield None
        return
    try:
        reg = obj.registry(create=False, write=False)
    except SchemaTooOldError:
        if location.path is None or schema.is_read_only_file(location.path):
            raise  # the real import refuses it too
        # A local file the real import upgrades first: the dry run shows it on an upgraded copy.
        with _upgraded_copy(location.path) as copy:
            click.echo(
                _upgraded_note(location, copy.upgraded_from).replace(
                    "note: upgraded", "note: the import would first upgrade"
                ),
                err=True,
            )
            yield copy
        return
    with reg:
        yield reg


@contextlib.contextmanager
def _upgraded_copy(path: Path) -> Iterator[Any]:
    """A ``Registry`` on a temporary copy of the SQLite file ``path``, upgraded to head."""
    import tempfile

    from ficache import schema
    from ficache.registry import Registry

    with tempfile.TemporaryDirectory(prefix="ficache-dry-run-") as tmp:
        copy = Path(tmp) / path.name
        schema.copy_sqlite_file(path, copy)
        with Registry.open(str(copy), create=False) as reg:
            yield reg


def _among_inputs(duplicates: int, conflicts: int) -> str:
    """``, N duplicates, M conflicts`` of an import's inputs; empty when both are 0."""
    return f", {duplicates} duplicates, {conflicts} conflicts" if duplicates or conflicts else ""


def _report_import(
    fmt: str, plan: Any, result: Any, source_noun: str, *, dry_run: bool = False
) -> None:
    """The report of one import (``ficache.importing.ImportPlan``), as text or JSON.

    Every input entry is in one count: added, replaced, unchanged,
    duplicates or conflicts (records likewise).
    """
    if fmt == "json":
        _dump_json(_import_json(plan, result, dry_run))
    else:
        _echo_import_summary(plan, result, source_noun, dry_run)
    _warn_of_conflicts(plan, source_noun)


def _commit_counts_json(plan: Any, result: Any, dry_run: bool) -> dict[str, Any]:
    """The fields every import's JSON report has, in their order: its commit and counts."""
    return {
        "commit": result.commit_id,
        "dry_run": dry_run,
        "on_conflict": plan.policy,
        "added": result.added,
        "replaced": result.replaced,
        "unchanged": result.unchanged,
        "duplicates": plan.duplicates,
        "conflicts": plan.conflicts,
    }


def _import_json(plan: Any, result: Any, dry_run: bool) -> dict[str, Any]:
    """An import's JSON report; the protocol record counts only where it held any."""
    return {
        "files": len(plan.sources),
        "entries": plan.entries,
        **_commit_counts_json(plan, result, dry_run),
        "records": plan.records,
        "records_added": result.records_added,
        "records_replaced": result.records_replaced,
        "records_unchanged": result.records_unchanged,
        "records_duplicates": plan.records_duplicates,
        "records_conflicts": plan.records_conflicts,
        "conflicting": _conflicts_json(plan),
        "conflicting_records": _conflicts_json(plan, records=True),
        **(
            {
                "protocol_records": plan.protocol_records,
                "protocol_added": result.protocol_added,
                "protocol_replaced": result.protocol_replaced,
                "protocol_unchanged": result.protocol_unchanged,
                "protocol_duplicates": plan.protocol_duplicates,
                "protocol_conflicts": plan.protocol_conflicts,
            }
            if plan.protocol_records
            else {}
        ),
    }


def _echo_import_summary(plan: Any, result: Any, source_noun: str, dry_run: bool) -> None:
    """An import's one-line text report: what it held, each count, and its outcome."""
    where = _import_outcome(result, dry_run)
    records = plan.records
    held = f"{plan.entries} entries and {records} records" if records else f"{plan.entries} entries"
    if plan.protocol_records:
        held += f" and {plan.protocol_records} protocol records"
    record_counts = (
        f"; records {result.records_added} added, {result.records_replaced} replaced, "
        f"{result.records_unchanged} unchanged"
        + _among_inputs(plan.records_duplicates, plan.records_conflicts)
        if records
        else ""
    )
    if plan.protocol_records:
        record_counts += (
            f"; protocol records {result.protocol_added} added, {result.protocol_replaced} "
            f"replaced, {result.protocol_unchanged} unchanged"
            + _among_inputs(plan.protocol_duplicates, plan.protocol_conflicts)
        )
    verb = "would import" if dry_run else "imported"
    click.echo(
        f"{verb} {held} from {len(plan.sources)} {source_noun}(s): {result.added} added, "
        f"{result.replaced} replaced, {result.unchanged} unchanged"
        f"{_among_inputs(plan.duplicates, plan.conflicts)}{record_counts} ({where})"
    )


def _import_outcome(result: Any, dry_run: bool) -> str:
    """How an import's summary line ends: its commit, no commit, or a dry run."""
    if dry_run:
        return "dry run: nothing changed"
    if result.commit_id is not None:
        return f"commit {result.commit_id}"
    return "nothing new, no commit"


def _conflicts_json(plan: Any, *, records: bool = False) -> list[dict[str, Any]]:
    """An import plan's conflicts (entries, or records), each naming its inputs."""
    return [
        {**c.as_json(), "files": [plan.sources[n - 1] for n, _v in c.sources]}
        for c in (plan.conflicting_records if records else plan.conflicting)
    ]


def _warn_of_conflicts(plan: Any, source_noun: str) -> None:
    """One stderr line when an import's inputs disagreed on some entries (the first named)."""
    if not plan.conflicting or plan.refused:
        return
    first = plan.conflicting[0]
    names = ", ".join(dict.fromkeys(plan.sources[n - 1] for n, _v in first.sources))
    n = len(plan.conflicting)
    click.echo(
        f"warning: {n} entr{'y' if n == 1 else 'ies'} held different values in two "
        f"{source_noun}s, resolved by --on-conflict {plan.policy}; first: {first.key[:160]} "
        f"({names}) -> {first.resolution}",
        err=True,
    )


def _import_from_vllm(obj: _Context, plan: Any, dry_run: bool, fmt: str) -> None:
    """``import --from-vllm`` (or ``--from-sglang``): one commit of what
    ``import_request.prepare_adoption`` found (none when it found nothing).

    ``dry_run``: the adoption previewed (``AdoptionPlan.preview``), reading the
    registry only. Over the guide's length: one JSON report and one text report, each
    field in the order users' scripts read it.
    """
    result = None
    if not plan.is_empty:
        with _import_registry(obj, dry_run) as reg:
            result = plan.preview(reg) if dry_run else plan.execute(reg)
            if dry_run and result.skipped:  # what the real run leaves out
                _say_skipped(result.skipped)
    if fmt == "json":
        _dump_json(_adoption_json(plan, result, dry_run))
    else:
        _echo_adoption(plan, result, dry_run)
    _warn_of_adoption(plan)


def _adoption_json(plan: Any, result: Any, dry_run: bool) -> dict[str, Any]:
    """``import --from-vllm --format json``: what was found, and what the commit did."""
    sources = plan.sources
    return {
        "roots": [str(p) for p in (*sources.roots, *sources.v2_roots)],
        "layouts": [g.as_json() for g in plan.layouts],
        "v2_environments": [s.as_json() for s in plan.stores],
        "files": plan.files,
        "entries": len(plan.entries),
        "shared": plan.shared,
        "scoped": plan.scoped,
        "conflicts": plan.conflicts,
        "skipped": plan.skipped_count,
        "records": len(plan.records),
        "records_shared": plan.records_shared,
        "records_scoped": plan.records_scoped,
        "record_conflicts": plan.record_conflicts,
        "ignored_records": plan.ignored_records,
        "commit": result.commit_id if result else None,
        "dry_run": dry_run,
        "added": result.added if result else 0,
        "replaced": result.replaced if result else 0,
        "unchanged": result.unchanged if result else 0,
        "records_added": result.records_added if result else 0,
        "records_replaced": result.records_replaced if result else 0,
        "records_unchanged": result.records_unchanged if result else 0,
        **_adopted_protocol_json(plan, result),
    }


def _adopted_protocol_json(plan: Any, result: Any) -> dict[str, int]:
    """An adoption report's protocol record counts; empty when it found none (the report of
    an adoption without them is what it was before they were adopted)."""
    if not plan.protocol_records:
        return {}
    return {
        "protocol_records": len(plan.protocol_records),
        "protocol_conflicts": plan.protocol_conflicts,
        "protocol_added": result.protocol_added if result else 0,
        "protocol_replaced": result.protocol_replaced if result else 0,
        "protocol_unchanged": result.protocol_unchanged if result else 0,
    }


def _echo_adoption(plan: Any, result: Any, dry_run: bool) -> None:
    """``import --from-vllm`` as text: a table of what was found, then one summary line."""
    from ficache.adopt import V2_STORE

    rows = [
        (g.kind, g.layout, len(g.files), g.shared, g.scoped, g.skipped, g.directory)
        for g in plan.layouts
    ]
    rows += [(V2_STORE, "shared", s.files, s.entries, 0, s.skipped, s.path) for s in plan.stores]
    if rows:
        click.echo(
            _table(["kind", "layout", "files", "shared", "scoped", "skipped", "directory"], rows)
        )
    sources = plan.sources
    if result is None and not rows:
        click.echo(f"found nothing to adopt under {sources.display}: {sources.searched_str}")
        return
    if result is None:
        click.echo(f"found nothing to adopt under {sources.display}")
        return
    where = _import_outcome(result, dry_run)
    held, record_counts = "", ""
    if plan.records:
        held = (
            f" and {len(plan.records)} records ({plan.records_shared} shared, "
            f"{plan.records_scoped} scoped)"
        )
        record_counts = (
            f"; records {result.records_added} added, {result.records_replaced} "
            f"replaced, {result.records_unchanged} unchanged"
        )
    if plan.protocol_records:
        held += f" and {len(plan.protocol_records)} protocol records (shared)"
        record_counts += (
            f"; protocol records {result.protocol_added} added, "
            f"{result.protocol_replaced} replaced, {result.protocol_unchanged} unchanged"
        )
    click.echo(
        f"{'would adopt' if dry_run else 'adopted'} {len(plan.entries)} entries ({plan.shared} shared, {plan.scoped} "
        f"scoped){held} from {plan.files} file(s): {result.added} added, "
        f"{result.replaced} replaced, {result.unchanged} unchanged{record_counts} "
        f"({where})"
    )


def _warn_of_adoption(plan: Any) -> None:
    """An adoption's stderr warnings: what it skipped, conflicts, protocol records left out."""
    engine_name = plan.sources.engine_name
    if plan.skipped_count:
        click.echo(
            f"warning: skipped {plan.skipped_count} unreadable file(s), entr(ies) or "
            f"environment(s); first: {plan.skipped[0]}",
            err=True,
        )
    if plan.conflicts:
        click.echo(
            f"warning: {plan.conflicts} entr(ies) held different values in two "
            f"{engine_name} caches; "
            "the later cache's value was kept (v2 store over per-rank files over a single file)",
            err=True,
        )
    if plan.record_conflicts:
        click.echo(
            f"warning: {plan.record_conflicts} record(s) held different values in two "
            f"{engine_name} caches; the later cache's value was kept",
            err=True,
        )
    if plan.protocol_conflicts:
        click.echo(
            f"warning: {plan.protocol_conflicts} protocol record(s) held different values in "
            "two v2 stores; the later store's value was kept",
            err=True,
        )


def _import_v2_stores(obj: _Context, read: Any, dry_run: bool, fmt: str) -> None:
    """``import`` of FlashInfer v2 stores (``import_request.prepare_store_import``): one commit."""
    with _import_registry(obj, dry_run) as reg:
        result = read.prepared.preview(reg) if dry_run else read.prepared.execute(reg)
        if dry_run and result.skipped:  # what the real run leaves out
            _say_skipped(result.skipped)
    if fmt == "json":
        _dump_json(_store_import_json(read, result, dry_run))
    else:
        _echo_store_import(read, result, dry_run)
    _warn_of_conflicts(read.prepared.plan, "store")
    skipped_entries = read.skipped_entries
    if skipped_entries:
        click.echo(
            f"warning: skipped {skipped_entries} malformed entr{'y' if skipped_entries == 1 else 'ies'}"
            f" (FlashInfer treats them as misses); first: {read.first_skipped_entry}",
            err=True,
        )
    changed = [s for s in read.skipped_environments if s.changed]
    malformed = [s for s in read.skipped_environments if not s.changed]
    if malformed:
        click.echo(
            f"warning: skipped {len(malformed)} environment(s) with a malformed manifest; "
            f"first: {malformed[0]}",
            err=True,
        )
    if changed:
        click.echo(
            f"warning: skipped {len(changed)} environment(s) whose entries changed while they "
            f"were read (another process writes that store); import again once it is done; "
            f"first: {changed[0]}",
            err=True,
        )


def _store_import_json(read: Any, result: Any, dry_run: bool) -> dict[str, Any]:
    """``import STORE... --format json``: every environment read, and what the commit did."""
    plan = read.prepared.plan
    return {
        "stores": len(read.stores),
        "environments": [
            {
                "env_hash": e.env_hash,
                "fingerprint": _digest_or_none(e.stored_fingerprint),
                "measurement": e.measurement_fields,
                "entries": len(e.entries),
                "skipped_entries": e.skipped,
                "records": e.records,
            }
            for e in read.environments
        ],
        "entries": read.entries,
        "skipped_entries": read.skipped_entries,
        "skipped_environments": len(read.skipped_environments),
        "ignored_records": 0,
        **(
            {
                "protocol_records": {
                    "read": plan.protocol_records,
                    "added": result.protocol_added,
                    "replaced": result.protocol_replaced,
                    "unchanged": result.protocol_unchanged,
                }
            }
            if read.protocol_records
            else {}
        ),
        **_commit_counts_json(plan, result, dry_run),
        "conflicting": _conflicts_json(plan),
    }


def _digest_or_none(fingerprint: Any) -> str | None:
    return None if fingerprint is None else str(fingerprint.digest)


def _echo_store_import(read: Any, result: Any, dry_run: bool) -> None:
    """``import STORE...`` as text: a table of the environments, then one summary line."""
    from ficache.v2_store import measurement_label

    envs = read.environments
    plan = read.prepared.plan
    if envs:
        click.echo(
            _table(
                ["environment", "fingerprint", "measurement", "entries", "skipped"],
                (
                    (
                        e.env_hash,
                        "-" if e.stored_fingerprint is None else e.stored_fingerprint.short_digest,
                        measurement_label(e.measurement_fields),
                        len(e.entries),
                        e.skipped,
                    )
                    for e in envs
                ),
            )
        )
    click.echo(
        f"{'would import' if dry_run else 'imported'} {read.entries} entries from {len(envs)} "
        f"environment(s): {result.added} added, {result.replaced} replaced, "
        f"{result.unchanged} unchanged{_among_inputs(plan.duplicates, plan.conflicts)} "
        f"({_import_outcome(result, dry_run)})"
    )
    if read.protocol_records:
        among = _among_inputs(plan.protocol_duplicates, plan.protocol_conflicts)
        click.echo(
            f"{'would import' if dry_run else 'imported'} {read.protocol_records} protocol "
            f"records (shared): {result.protocol_added} added, {result.protocol_replaced} "
            f"replaced, {result.protocol_unchanged} unchanged{among}"
        )


@cli.command("export")
@click.option(
    "--fingerprint",
    "fingerprint_refs",
    multiple=True,
    metavar="ID|current",
    help="A stored fingerprint id, or `current` for what this environment would load "
    "(repeatable with --bundle).",
)
@click.option(
    "--scope",
    callback=_check_scope,
    default="shared",
    show_default=True,
    help="Also include the entries of '<layout>/rank<N>' (they win over shared ones).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    help="Write the cache file here instead of stdout (`-`: stdout). A file is "
    "replaced atomically, keeping its mode; a device or FIFO is written to.",
)
@click.option(
    "--bundle",
    "bundle_path",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    help="Write a ficache bundle here instead (`-`: stdout): every scope of the given "
    "fingerprints (or --all), reproducible byte for byte.",
)
@click.option("--all", "all_fingerprints", is_flag=True, help="With --bundle: every fingerprint.")
@click.option(
    "--v2-store",
    "v2_root",
    type=click.Path(path_type=Path),
    metavar="DIR",
    help="Publish the entries into this FlashInfer v2 store root (autotune_v2's "
    "cache_root) instead, where FlashInfer's lookup and preload serve them.",
)
@click.option(
    "--measurement-policy",
    "measurement_spec",
    metavar="default|FIELD=VALUE,...",
    help="With --v2-store: the MeasurementPolicy the server attaches with "
    "(execution_mode, cold_l2, timer, graph_timing) [default: the one recorded at import].",
)
@pass_ctx
def export_cmd(
    obj: _Context,
    fingerprint_refs: tuple[str, ...],
    scope: str,
    output: Path | None,
    bundle_path: Path | None,
    all_fingerprints: bool,
    v2_root: Path | None,
    measurement_spec: str | None,
) -> None:
    """Export a FlashInfer cache file that AutoTuner.load_configs accepts, or a bundle.

    With --bundle FILE, write one ficache bundle (for images) holding every
    scope of the given stored fingerprints, or of all with --all.

    With --v2-store DIR, publish a FlashInfer v2 store (`autotune_v2`) instead:
    one environment directory per measurement policy the entries were tuned
    under; exporting twice gives identical files.
    """
    if v2_root is not None:
        if bundle_path is not None or output is not None or all_fingerprints:
            raise click.UsageError("--v2-store is its own output; drop --bundle/--all/-o")
        if len(fingerprint_refs) != 1:
            raise click.UsageError("--v2-store needs one --fingerprint ID|current")
        _export_v2_store(obj, v2_root, fingerprint_refs[0], scope, measurement_spec)
        return
    if measurement_spec is not None:
        raise click.UsageError("--measurement-policy needs --v2-store DIR")
    if bundle_path is not None:
        _export_bundle(obj, bundle_path, fingerprint_refs, all_fingerprints, scope, output)
        return
    if all_fingerprints:
        raise click.UsageError("--all needs --bundle FILE")
    if len(fingerprint_refs) != 1:
        raise click.UsageError("give one --fingerprint ID|current (several need --bundle FILE)")
    from ficache.exporting import export_file

    [fingerprint_ref] = fingerprint_refs
    with obj.registry(create=False, write=False) as reg:
        export = export_file(reg, fingerprint_ref, scope=scope)
        scope_note = _unstored_scope_note(reg, export.fingerprint_ids, scope)
    if output is None:
        click.echo(export.text, nl=False)
    else:
        _write_output(output, export.text.encode("utf-8"))
        click.echo(f"wrote {export.entries} entries to {_output_name(output)}", err=True)
    if scope_note:
        click.echo(scope_note, err=True)


def _unstored_scope_note(reg: Any, ids: Sequence[int], scope: str) -> str | None:
    """The warning for an export ``--scope`` that nothing of fingerprints ``ids`` is stored under."""
    from ficache.catalog import unstored_scope

    rank_scopes = unstored_scope(reg, ids, scope)
    if rank_scopes is None:
        return None
    which = f"fingerprint {ids[0]}" if len(ids) == 1 else f"fingerprints {_listed(ids)}"
    stored = f"its rank scopes: {_listed(rank_scopes)}" if rank_scopes else "it has no rank scopes"
    return (
        f"warning: {which} holds nothing scoped to {scope} ({stored}); "
        "exported the shared entries only"
    )


def _listed(values: Sequence[Any], most: int = 6) -> str:
    """``a, b, c`` (at most ``most`` of ``values``, then how many more)."""
    shown = ", ".join(str(v) for v in values[:most])
    return shown + (f" and {len(values) - most} more" if len(values) > most else "")


def _is_stdout(path: Path) -> bool:
    return str(path) == "-"


def _output_name(path: Path) -> str:
    return "standard output" if _is_stdout(path) else str(path)


def _write_output(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (``-``: standard output) or fail with one line."""
    from ficache.publish import publish

    if _is_stdout(path):
        click.echo(data, nl=False)  # bytes go to the binary stream, as they are
        return
    try:
        publish(path, data)
    except OSError as exc:
        _fail(f"cannot write {path}: {exc.strerror}")


def _export_v2_store(
    obj: _Context, root: Path, fingerprint_ref: str, scope: str, measurement_spec: str | None
) -> None:
    """``export --v2-store``: the library plans and writes, the CLI prints."""
    from ficache.exporting import plan_v2_exports, source_fingerprint_ids
    from ficache.v2_store import measurement_label, parse_measurement_policy

    measurement = (
        parse_measurement_policy(measurement_spec) if measurement_spec is not None else None
    )
    with obj.registry(create=False, write=False) as reg:
        exports = plan_v2_exports(reg, fingerprint_ref, scope=scope, measurement=measurement)
        ids = source_fingerprint_ids(reg, fingerprint_ref)
        scope_note = _unstored_scope_note(reg, ids, scope)
    for export in exports:  # one environment directory per measurement policy
        result = export.write(root)
        lazy = (
            f"; {export.not_preloadable} not preloadable, served by lookup only"
            if export.not_preloadable
            else ""
        )
        n_protocol = export.protocol_records
        protocol = f" and {n_protocol} protocol records" if n_protocol else ""
        click.echo(
            f"exported {len(export.files) - n_protocol} entries{protocol} to {result.env_dir} "
            f"(measurement policy {measurement_label(export.measurement)}): "
            f"{result.written} written, {result.unchanged} unchanged{lazy}"
        )
    left_out = sum(export.records_left_out for export in exports)
    if left_out:
        click.echo(
            f"warning: {left_out} namespaced record{'' if left_out == 1 else 's'} (_records) "
            "not exported: a v2 store has no place for them; export a file (-o FILE) or a "
            "bundle (--bundle) to carry them",
            err=True,
        )
    if scope_note:
        click.echo(scope_note, err=True)


def _export_bundle(
    obj: _Context,
    path: Path,
    fingerprint_refs: tuple[str, ...],
    all_fingerprints: bool,
    scope: str,
    output: Path | None,
) -> None:
    """``export --bundle``: the library writes, the CLI checks options and prints."""
    from ficache.exporting import bundle_bytes, write_bundle

    if all_fingerprints == bool(fingerprint_refs):
        raise click.UsageError("--bundle needs --fingerprint ID (repeatable) or --all")
    if "current" in fingerprint_refs:
        raise click.UsageError("--bundle takes stored fingerprint ids or digests, not `current`")
    if scope != "shared" or output is not None:
        raise click.UsageError("--bundle holds every scope and is its own output; drop --scope/-o")
    with obj.registry(create=False, write=False) as reg:
        ids = None if all_fingerprints else [reg.fingerprint(ref).id for ref in fingerprint_refs]
        if _is_stdout(path):
            data, summary = bundle_bytes(reg, ids, path=path)
        else:
            summary = write_bundle(reg, path, ids)
    if _is_stdout(path):
        _write_output(path, data)
    records = f" and {summary.records} records" if summary.records else ""
    if summary.protocol_records:
        records += f" and {summary.protocol_records} protocol records"
    click.echo(
        f"wrote bundle {_output_name(path)}: {summary.entries} entries{records} of "
        f"{summary.fingerprints} fingerprint(s), {summary.size_bytes} bytes, "
        f"sha256 {summary.digest}",
        err=_is_stdout(path),  # stdout is then exactly the bundle
    )


# -- inspection ---------------------------------------------------------------


@cli.command("list")
@click.option(
    "--op",
    help="Only entries of this custom op, or of every op whose name contains it (any case).",
)
@click.option("--gpu", help="Only entries of fingerprints with this GPU name.")
@click.option(
    "--flashinfer-version", help="Only entries of fingerprints with this FlashInfer version."
)
@click.option(
    "--fingerprint",
    "fingerprint_ref",
    metavar="ID",
    help="Only entries of this stored fingerprint.",
)
@click.option(
    "--scope",
    callback=_check_scope,
    help="Only entries of this scope ('shared' or '<layout>/rank<N>').",
)
@click.option("--limit", type=POSITIVE_ID, help="Show at most this many entries.")
@click.option(
    "--records",
    "show_records",
    is_flag=True,
    help="List FlashInfer's namespaced records (_records) instead of entries.",
)
@click.option(
    "--protocol-records",
    "show_protocol",
    is_flag=True,
    help="List FlashInfer 0.7.4's protocol records instead of entries.",
)
@click.option(
    "--namespace", help="With --records or --protocol-records: only records of this namespace."
)
@FORMAT
@pass_ctx
def list_cmd(
    obj: _Context,
    op: str | None,
    gpu: str | None,
    flashinfer_version: str | None,
    fingerprint_ref: str | None,
    scope: str | None,
    limit: int | None,
    show_records: bool,
    show_protocol: bool,
    namespace: str | None,
    fmt: str,
) -> None:
    """List stored entries, or with --records the namespaced records, or with
    --protocol-records FlashInfer 0.7.4's protocol records."""
    records_flag = _listed_records(show_records, show_protocol, op, gpu, flashinfer_version)
    if namespace is not None and records_flag is None:
        raise click.UsageError("--namespace goes with --records")
    with obj.registry(create=False, write=False) as reg:
        ids = [reg.fingerprint(fingerprint_ref).id] if fingerprint_ref else None
        if records_flag is not None:
            _list_records(reg, records_flag, ids, scope, namespace, limit, fmt)
            return
        notes = _list_entries(reg, ids, op, gpu, flashinfer_version, scope, limit, fmt)
    for note in notes:
        click.echo(note, err=True)


#: The records ``list`` shows instead of entries: its flag -> the kind's name (``ficache.kinds``).
_LISTED_KINDS = {"--records": "record", "--protocol-records": "protocol record"}


def _listed_records(
    show_records: bool,
    show_protocol: bool,
    op: str | None,
    gpu: str | None,
    flashinfer_version: str | None,
) -> str | None:
    """The flag of the records ``list`` shows instead of entries (None: entries), after
    checking that the entries' filters are not given with it."""
    if show_records and show_protocol:
        raise click.UsageError("give --records or --protocol-records, not both")
    flag = "--records" if show_records else "--protocol-records" if show_protocol else None
    if flag is not None and (op is not None or gpu is not None or flashinfer_version is not None):
        raise click.UsageError(f"{flag} takes --fingerprint, --scope, --namespace and --limit")
    return flag


def _list_entries(
    reg: Any,
    ids: list[int] | None,
    op: str | None,
    gpu: str | None,
    flashinfer_version: str | None,
    scope: str | None,
    limit: int | None,
    fmt: str,
) -> list[str]:
    """``list``'s entries, as JSON or a table; returns the warnings to show after them
    (filters no stored fingerprint matches, or no entry listed)."""
    from ficache.catalog import stored_filter_misses

    field_filters = {"gpu": gpu, "flashinfer_version": flashinfer_version}
    notes = _filter_miss_notes(stored_filter_misses(reg, field_filters, ids), ids)
    listed = [0]

    def counted(entries: Iterable[Any]) -> Iterator[Any]:
        for entry in entries:
            listed[0] += 1
            yield entry

    ops = None
    if op is not None:
        ops, suggestions = reg.ops_matching(op)
        if not ops:
            hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
            notes.append(f"warning: no stored op is or contains {op!r}{hint}")
        elif ops != [op]:
            notes.append(f"note: --op {op!r} matched {len(ops)} op(s): {', '.join(ops)}")
    rows = counted(
        reg.entries(
            fingerprint_ids=ids,
            ops=ops,
            gpu=gpu,
            flashinfer_version=flashinfer_version,
            scope=scope,
            limit=limit,
        )
    )
    if fmt == "json":
        click.echo("[", nl=False)
        for i, entry in enumerate(rows):
            click.echo(("," if i else "") + "\n  " + json.dumps(entry.as_json()), nl=False)
        click.echo("\n]")
    else:
        _echo_entries(rows)
    given = {"--op": op, "--scope": scope}
    if not notes and not listed[0] and any(v is not None for v in given.values()):
        notes = [f"warning: no stored entry matches {_options(given)}"]
    return notes


def _options(values: dict[str, str | None]) -> str:
    """``--gpu 'X' and --op 'y'``: the options of ``values`` that were given."""
    return " and ".join(f"{opt} {value!r}" for opt, value in values.items() if value is not None)


def _filter_miss_notes(misses: Sequence[Any], ids: Sequence[int] | None) -> list[str]:
    """A warning per ``catalog.FilterMiss``: among all fingerprints, or those of ``ids``."""
    from ficache.fingerprint import shown

    notes = []
    for miss in misses:
        options = _options({"--" + f.replace("_", "-"): v for f, v in miss.filters})
        if len(miss.filters) > 1:
            who = (
                "no stored fingerprint matches"
                if ids is None
                else f"fingerprint {ids[0]} does not match"
            )
            notes.append(f"warning: {who} {options} together")
            continue
        existing = [shown(v) if shown(v) != v else repr(v) for v in miss.existing]
        if ids is None:
            stored = f"stored: {_listed(existing)}" if existing else "the registry holds none"
            notes.append(f"warning: {options} matches no stored fingerprint; {stored}")
        else:
            notes.append(
                f"warning: {options} does not match fingerprint {ids[0]}, which has {existing[0]}"
            )
    return notes


def _echo_entries(rows: Iterable[Any]) -> None:
    """``list``'s table of entries."""
    click.echo(
        _table(
            ["fingerprint", "scope", "op", "runner", "shapes", "extras", "tactic", "commit"],
            (
                (
                    e.fingerprint_id,
                    e.scope,
                    e.op,
                    e.runner,
                    e.shapes,
                    e.extras,
                    e.tactic_json,
                    e.commit_id,
                )
                for e in rows
            ),
        )
    )


def _list_records(
    reg: Any,
    flag: str,
    ids: list[int] | None,
    scope: str | None,
    namespace: str | None,
    limit: int | None,
    fmt: str,
) -> None:
    """``list --records`` / ``--protocol-records``: one row per stored record of the
    flag's kind (``ficache.kind_read.list_stored``)."""
    from ficache.kind_read import list_stored
    from ficache.kinds import kind_named

    kind = kind_named(_LISTED_KINDS[flag])
    rows = list_stored(
        reg, kind, fingerprint_ids=ids, scope=scope, namespace=namespace, limit=limit
    )
    if fmt == "json":
        _dump_json([r.as_json() for r in rows])
        return
    identity, values = kind.item_identity, kind.item_values
    click.echo(
        _table(
            [
                *("fingerprint", "scope", *identity),
                *(name.removesuffix("_json") for name in values),
                "commit",
            ],
            (
                (
                    *(r.fingerprint_id, r.scope, *(getattr(r, name) for name in identity)),
                    *(_cut_json(getattr(r, name)) for name in values),
                    r.commit_id,
                )
                for r in rows
            ),
        )
    )


def _cut_json(text: str | None) -> str:
    """A JSON text as ``list`` shows it: whole up to 60 characters, else cut, ending in
    "..."; ``-`` for none."""
    if text is None:
        return "-"
    return text if len(text) <= 60 else text[:57] + "..."


@cli.command("stats")
@FORMAT
@pass_ctx
def stats_cmd(obj: _Context, fmt: str) -> None:
    """Summarise the registry: fingerprints, entries, ops, commits, and per fingerprint when a
    start last served it, how many starts it served, and the misses of its replay starts."""
    with obj.registry(create=False, write=False) as reg:
        stats = reg.stats()
    if fmt == "json":
        _dump_json(stats.as_json())
        return
    click.echo(
        _table(
            ["", ""],
            [
                ("registry", stats.location),
                ("schema revision", stats.revision),
                ("size", f"{stats.size_bytes} bytes" if stats.size_bytes is not None else "-"),
                ("fingerprints", stats.fingerprints),
                (
                    "entries",
                    f"{stats.entries} ({stats.shared_entries} shared, {stats.scoped_entries} rank-scoped)",
                ),
                ("commits", stats.commits),
                ("last commit", _when(stats.last_commit_at)),
                *([("records", stats.records)] if stats.records else []),
                *([("protocol records", stats.protocol_records)] if stats.protocol_records else []),
            ],
        )
    )
    if stats.ops:
        click.echo()
        click.echo(_table(["op", "entries"], stats.ops))
    if stats.record_namespaces:
        click.echo()
        click.echo(_table(["fingerprint", "namespace", "records"], stats.record_namespaces))
    if stats.protocol_namespaces:
        click.echo()
        click.echo(
            _table(["fingerprint", "namespace", "protocol records"], stats.protocol_namespaces)
        )
    if stats.last_served:
        counts = {fid: rest for fid, *rest in stats.start_counts}
        click.echo()
        click.echo(
            _table(
                ["fingerprint", "last served", "starts", "replay starts", "replay misses"],
                [
                    (fid, _served(served), *counts.get(fid, (0, 0, 0)))
                    for fid, served in stats.last_served
                ],
            )
        )


@cli.command("log")
@click.option(
    "--limit",
    type=POSITIVE_ID,
    default=20,
    show_default=True,
    help="Show at most this many commits, newest first.",
)
@click.option(
    "--since",
    type=AgeType(),
    default=None,
    help="Only commits made within this age (30d, 12h, 90min, 2w).",
)
@click.option(
    "--kind",
    "kinds",
    multiple=True,
    type=click.Choice(values.COMMIT_KINDS),
    help="Only commits of this kind (repeatable).",
)
@click.option("--host", "hosts", multiple=True, help="Only commits made on this host (repeatable).")
@click.option(
    "--before",
    type=POSITIVE_ID,
    default=None,
    help="Only commits older than this id: the next page (the text output names it).",
)
@FORMAT
@pass_ctx
def log_cmd(
    obj: _Context,
    limit: int,
    since: float | None,
    kinds: tuple[str, ...],
    hosts: tuple[str, ...],
    before: int | None,
    fmt: str,
) -> None:
    """Show the newest commits with their provenance, filtered and paged."""
    from ficache.commit_log import LogFilter

    where = LogFilter(
        since=None if since is None else time.time() - since,
        kinds=kinds,
        hosts=hosts,
        before=before,
    )
    with obj.registry(create=False, write=False) as reg:
        # One more than shown: whether a next page exists.
        commits = reg.log(limit + 1, where=where)
    more, commits = len(commits) > limit, commits[:limit]
    if fmt == "json":
        _dump_json([c.as_json() for c in commits])
        return
    _echo_log_table(commits)
    if more:
        click.echo(f"(more: ficache log --before {commits[-1].id} with the same filters)")


def _echo_log_table(commits: Sequence[Any]) -> None:
    """``log``'s table; a records or protocol column only where a shown commit changed some."""
    # A records column (added/replaced/removed) only where a shown commit changed records.
    with_records = any(c.records_added or c.records_replaced or c.records_removed for c in commits)
    with_protocol = any(
        c.protocol_added or c.protocol_replaced or c.protocol_removed for c in commits
    )
    click.echo(
        _table(
            [
                "commit",
                "when",
                "kind",
                "host",
                "added",
                "replaced",
                "removed",
                *(["records +/~/-"] if with_records else []),
                *(["protocol +/~/-"] if with_protocol else []),
                "world",
                "layout",
                "message",
            ],
            (
                (
                    c.id,
                    _when(c.created_at),
                    c.kind,
                    c.host,
                    c.added,
                    c.replaced,
                    c.removed,
                    *(
                        [f"{c.records_added}/{c.records_replaced}/{c.records_removed}"]
                        if with_records
                        else []
                    ),
                    *(
                        [f"{c.protocol_added}/{c.protocol_replaced}/{c.protocol_removed}"]
                        if with_protocol
                        else []
                    ),
                    c.world_size,
                    c.layout,
                    (c.message or "")[:60],
                )
                for c in commits
            ),
        )
    )


def _change_value(value: Any, *, known: bool = True) -> str:
    """A value of ``show``'s table: ``-`` for none, ``?`` for one history did not keep."""
    if value is not None:
        return str(value)
    return "-" if known else "?"


#: ``show``'s text lists at most this many changes of each kind unless ``--limit`` says.
SHOW_LIMIT = 100


@cli.command("show")
@click.argument("commit_id", type=POSITIVE_ID)
@click.option(
    "--stat",
    is_flag=True,
    help="Count the changes per op (entries) and namespace (records) instead of listing them.",
)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=SHOW_LIMIT,
    show_default=True,
    help="List at most this many changes of each kind in the text output; 0 lists all "
    "(JSON always lists all).",
)
@FORMAT
@pass_ctx
def show_cmd(obj: _Context, commit_id: int, stat: bool, limit: int, fmt: str) -> None:
    """Show one commit: its provenance and every entry it added, replaced or removed."""
    from ficache.history import change_stat, commit_details

    with obj.registry(create=False, write=False) as reg:
        details = commit_details(reg, commit_id)
    if stat:
        stats = change_stat(details)
        if fmt == "json":
            _dump_json({"commit": details.commit.as_json(), "stat": [s.as_json() for s in stats]})
            return
        _echo_commit_summary(details)
        click.echo(
            _table(
                ["kind", "op or namespace", "added", "replaced", "removed"],
                ((s.kind, s.group, s.added, s.replaced, s.removed) for s in stats),
            )
        )
        return
    if fmt == "json":
        _dump_json(details.as_json())
        return
    _echo_commit_summary(details)
    _echo_commit_changes(details, limit or None)


def _echo_commit_summary(details: Any) -> None:
    """``show``'s text lines above its tables: the commit, its counts, its provenance."""
    c = details.commit
    who = f"{c.user}@{c.host}" if c.user else c.host
    click.echo(f"commit {c.id}: {c.kind}, {_when(c.created_at)}, {who}")
    if c.message:
        click.echo(f"message: {c.message}")
    if c.reverts_commit_id is not None:
        click.echo(f"reverts: commit {c.reverts_commit_id}")
    if c.world_size is not None or c.layout is not None:
        click.echo(
            f"world: {c.world_size if c.world_size is not None else '-'}, layout: {c.layout or '-'}"
        )
    click.echo(f"changes: {c.added} added, {c.replaced} replaced, {c.removed} removed")
    if details.record_changes:
        click.echo(
            f"record changes: {c.records_added} added, {c.records_replaced} replaced, "
            f"{c.records_removed} removed"
        )
    if details.protocol_changes:
        click.echo(
            f"protocol record changes: {c.protocol_added} added, {c.protocol_replaced} replaced, "
            f"{c.protocol_removed} removed"
        )
    if c.provenance:
        click.echo("provenance:")
        for line in json.dumps(c.provenance, indent=2, sort_keys=True).splitlines():
            click.echo(f"  {line}")


def _echo_commit_changes(details: Any, limit: int | None) -> None:
    """``show``'s tables: the entries changed, then the records and protocol records, if
    any; at most ``limit`` rows of each, and a line saying how many more there are."""
    rows = []
    for ch in details.changes[:limit]:
        kf = ch.key_fields
        rows.append(
            (
                ch.action,
                ch.fingerprint_id,
                ch.scope,
                kf.op if kf is not None else ch.key,
                kf.runner if kf is not None else "",
                kf.shapes_json if kf is not None else "",
                kf.extras if kf is not None else "",
                _change_value(ch.old),
                _change_value(ch.new, known=ch.new_known),
            )
        )
    click.echo(
        _table(
            ["action", "fingerprint", "scope", "op", "runner", "shapes", "extras", "old", "new"],
            rows,
        )
    )
    _say_more(len(details.changes), limit, "entry changes")
    if details.record_changes:
        click.echo(_record_changes_table(details.record_changes[:limit]))
        _say_more(len(details.record_changes), limit, "record changes")
    if details.protocol_changes:
        click.echo(_record_changes_table(details.protocol_changes[:limit]))
        _say_more(len(details.protocol_changes), limit, "protocol record changes")


def _say_more(total: int, limit: int | None, what: str) -> None:
    if limit is not None and total > limit:
        click.echo(
            f"... {total - limit} more {what} of {total}: --limit 0 lists all, --stat counts them"
        )


def _record_changes_table(changes: Any) -> str:
    """``show``'s table of one commit's changed records (or protocol records)."""
    return _table(
        ["action", "fingerprint", "scope", "namespace", "key", "old", "new"],
        (
            (
                r.action,
                r.fingerprint_id,
                r.scope,
                r.namespace,
                r.key,
                _change_value(r.old),
                _change_value(r.new),
            )
            for r in changes
        ),
    )


# -- merge ---------------------------------------------------------------------------

#: What a text merge plan lists without --verbose (--verbose and JSON list everything):
#: sources, (fingerprint, scope, op) groups (beyond it, one row per op), conflicts of
#: entries and of records.
SHOWN_SOURCES = 10
SHOWN_GROUPS = 20
SHOWN_CONFLICTS = 10
#: A conflict's sources are named one by one up to this many; beyond, counted per value,
#: the SHOWN_VALUES most held values shown.
SHOWN_HOLDERS = 4
SHOWN_VALUES = 3
_ALL = "--verbose or --format json for all"


def _echo_merge_plan(plan: Any, *, verbose: bool = False) -> None:
    """The plan as text: a summary bounded by the ``SHOWN_*`` limits, or all of it (``verbose``).

    Each part is cut at its limit with one "... N more" line, so a merge of
    hundreds of sources prints tens of lines, not one line per source per
    conflict; ``--format json`` holds every source, group and conflict.
    """
    click.echo(f"merge plan (on conflict: {plan.policy}, {len(plan.sources)} source(s)):")
    sources = plan.sources if verbose else plan.sources[:SHOWN_SOURCES]
    click.echo(
        _table(
            ["source", "kind", "entries", "sha256", "name"],
            ((n, s.kind, s.entries, s.digest[:12], s.name) for n, s in enumerate(sources, start=1)),
        )
    )
    _echo_more(len(plan.sources) - len(sources), "source(s)")
    if verbose or len(plan.groups) <= SHOWN_GROUPS:
        _echo_merge_groups(plan.groups)
    else:
        _echo_merge_ops(plan.groups)
    if plan.conflicts:
        click.echo(f"conflicts ({plan.conflicting}):")
        shown = plan.conflicts if verbose else plan.conflicts[:SHOWN_CONFLICTS]
        for c in shown:
            where = (
                c.fingerprint_id if c.fingerprint_id is not None else f"new {c.fingerprint[:12]}"
            )
            held = _conflict_values(c.target, c.sources, verbose=verbose)
            click.echo(f"  {where} {c.scope} {c.key}: {held} -> {c.resolution}")
        _echo_more(plan.conflicting - len(shown), "conflict(s)")
    for records, noun in ((plan.records, "record"), (plan.protocol, "protocol record")):
        if not records.candidates:
            continue
        click.echo(
            f"{noun}s: {records.added} added, {records.replaced} replaced, {records.removed} "
            f"removed, {records.identical} identical, {len(records.conflicts)} conflicting"
        )
        shown_records = records.conflicts if verbose else records.conflicts[:SHOWN_CONFLICTS]
        for rc in shown_records:
            where = (
                rc.fingerprint_id if rc.fingerprint_id is not None else f"new {rc.fingerprint[:12]}"
            )
            held = _conflict_values(rc.target, rc.sources, verbose=verbose)
            click.echo(
                f"  {noun} {where} {rc.scope} {rc.namespace} {rc.key}: {held} -> {rc.resolution}"
            )
        _echo_more(len(records.conflicts) - len(shown_records), f"{noun} conflict(s)")
    click.echo(f"total: {plan.totals_str}")


def _echo_more(left_out: int, what: str) -> None:
    if left_out > 0:
        click.echo(f"  ... {left_out} more {what}; {_ALL}")


_GROUP_COUNTS = ("added", "replaced", "removed", "identical", "conflicting")


def _echo_merge_groups(groups: Sequence[Any]) -> None:
    """One row per (fingerprint, scope, op) of the plan."""
    if groups:
        click.echo(
            _table(
                ["fingerprint", "digest", "gpu", "scope", "op", *_GROUP_COUNTS],
                (
                    (
                        g.fingerprint_id if g.fingerprint_id is not None else "new",
                        g.fingerprint[:12],
                        g.gpu,
                        g.scope,
                        g.op,
                        *(getattr(g, name) for name in _GROUP_COUNTS),
                    )
                    for g in groups
                ),
            )
        )


def _echo_merge_ops(groups: Sequence[Any]) -> None:
    """The groups' counts summed per op (the summary of a plan with many groups)."""
    per_op: dict[str, list[int]] = {}
    for g in groups:
        counts = per_op.setdefault(g.op, [0] * (1 + len(_GROUP_COUNTS)))
        counts[0] += 1
        for i, name in enumerate(_GROUP_COUNTS, start=1):
            counts[i] += getattr(g, name)
    click.echo(_table(["op", "groups", *_GROUP_COUNTS], ((op, *c) for op, c in per_op.items())))
    fingerprints = len({g.fingerprint for g in groups})
    click.echo(
        f"  ({len(groups)} fingerprint/scope/op groups in {fingerprints} fingerprint(s); {_ALL})"
    )


def _conflict_values(target: Any, sources: Sequence[tuple[int, Any]], *, verbose: bool) -> str:
    """The values a conflict holds: each source's, or (many sources) each value's count."""
    held = [f"target {target}"] if target is not None else []
    if verbose or len(sources) <= SHOWN_HOLDERS:
        return "; ".join([*held, *(f"source {n} {v}" for n, v in sources)])
    counts: dict[str, list[int]] = {}  # value -> source numbers, in source order
    for n, v in sources:
        counts.setdefault(str(v), []).append(n)
    ranked = sorted(counts.items(), key=lambda item: (-len(item[1]), item[1][0]))
    values = ", ".join(
        f"{v} (source {ns[0]}{f' and {len(ns) - 1} more' if len(ns) > 1 else ''})"
        for v, ns in ranked[:SHOWN_VALUES]
    )
    if len(ranked) > SHOWN_VALUES:
        values += f", {len(ranked) - SHOWN_VALUES} more value(s)"
    held.append(f"{len(sources)} sources hold {len(counts)} value(s): {values}")
    return "; ".join(held)


@cli.command("merge")
@click.argument("sources", nargs=-1, required=True, metavar="SOURCE...")
@on_conflict_option(
    "a conflict",
    keep="the registry's",
    theirs="the last source's",
    vote="the most sources'",
    drop="remove the key",
    fail="change nothing and exit 1",
)
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option(
    "-v",
    "--verbose",
    is_flag=True,
    help="List every source, group and conflict (with each source's value) in the text plan "
    "[default: a summary; --format json lists all].",
)
@FORMAT
@pass_ctx
def merge_cmd(
    obj: _Context, sources: tuple[str, ...], policy: str, dry_run: bool, verbose: bool, fmt: str
) -> None:
    """Merge registries, FlashInfer cache files and bundles into the registry as one commit.

    A SOURCE is another registry (a path or SQLAlchemy URL), a FlashInfer
    cache file or a bundle. Every source is read and verified first: one
    damaged source merges nothing. A conflict is one fingerprint, scope and
    key with different values; --on-conflict decides. Merging the same
    sources again changes nothing. Revert a merge with `ficache revert`.
    """
    from ficache.merge import merge_sources, plan_merge, read_sources

    with _progress(sources, "reading sources") as items:
        opened = read_sources(items)
    for source in opened:
        if source.unreadable_keys:
            from ficache.flashinfer_format import unreadable_note

            click.echo(
                f"warning: {source.name}: {unreadable_note(source.unreadable_keys)}", err=True
            )
    with obj.registry(create=not dry_run, write=not dry_run) as reg:
        if dry_run:
            plan, result = plan_merge(reg, opened, policy), None
            from ficache.kinds import PROTOCOL_KIND

            protocol = plan.protocol.write.records
            if protocol and not reg.features.has_table(PROTOCOL_KIND.rows.name):
                # What the real merge leaves out of an older schema, said alike.
                _say_skipped(
                    reg.features.skipped(f"{len(protocol)} protocol records", reg.location)
                )
        else:
            reg.require_writable()
            plan, result = merge_sources(reg, opened, policy)
    commit_id = result.commit_id if result is not None else None
    if fmt == "json":
        _dump_json({**plan.as_json(), "dry_run": dry_run, "commit": commit_id})
    else:
        _echo_merge_plan(plan, verbose=verbose)
        if dry_run and not plan.refused:
            click.echo("dry run: nothing changed")
        elif result is not None and commit_id is None:
            click.echo("nothing to change, no commit")
        elif result is not None:
            records = (
                f"; records {result.records_added} added, {result.records_replaced} replaced, "
                f"{result.records_removed} removed"
                if result.records_changed
                else ""
            )
            if result.protocol_changed:
                records += (
                    f"; protocol records {result.protocol_added} added, "
                    f"{result.protocol_replaced} replaced, {result.protocol_removed} removed"
                )
            click.echo(
                f"merged as commit {commit_id}: {result.added} added, "
                f"{result.replaced} replaced, {result.removed} removed{records}"
            )
    plan.check()  # a refused plan: one error line, exit 1


# -- destructive ----------------------------------------------------------------


@cli.command("prune")
@click.option(
    "--fingerprint",
    "fingerprint_refs",
    multiple=True,
    metavar="ID",
    help="Remove the entries and records of this stored fingerprint (repeatable).",
)
@click.option(
    "--flashinfer-version",
    "versions",
    multiple=True,
    metavar="VERSION",
    help="Remove entries and records of fingerprints with this FlashInfer version (repeatable).",
)
@click.option(
    "--older-than",
    type=AgeType(),
    help="Remove entries and records last written before this age (30d, 12h, 90min, 6mo).",
)
@click.option(
    "--unused-for",
    type=AgeType(),
    help="Remove entries and records of fingerprints no warm start served for this age (30d); "
    "one never served counts from when it was stored.",
)
@click.option(
    "--scope", callback=_check_scope, help="Remove only entries and records of this scope."
)
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def prune_cmd(
    obj: _Context,
    fingerprint_refs: tuple[str, ...],
    versions: tuple[str, ...],
    older_than: float | None,
    unused_for: float | None,
    scope: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Remove entries and records matching all given criteria, as one revertible commit.

    FlashInfer's namespaced records (_records) follow the same criteria as
    entries: --fingerprint, --flashinfer-version and --unused-for select whole
    fingerprints (all their records go), --scope and --older-than narrow
    records as they narrow entries. `ficache revert` restores both.
    """
    if not (fingerprint_refs or versions or scope) and older_than is None and unused_for is None:
        raise click.UsageError(
            "prune needs a criterion: --fingerprint, --flashinfer-version, --older-than, "
            "--unused-for or --scope"
        )
    with obj.registry(create=False) as reg:
        reg.require_writable()
        ids = [reg.fingerprint(ref).id for ref in fingerprint_refs]
        try:
            plan = reg.plan_prune(
                fingerprint_ids=ids,
                flashinfer_versions=versions,
                older_than_seconds=older_than,
                scope=scope,
                unused_for_seconds=unused_for,
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        if plan.is_empty:
            click.echo("nothing matches: nothing to prune")
            return
        what = _echo_prune_plan(plan)
        click.echo(f"{what} would be removed (revertible with `ficache revert`)")
        _confirm_or_stop(f"Remove {what}?", dry_run=dry_run, yes=yes)
        result = plan.execute(reg)
    records = f" and {result.records_removed} records" if plan.records_total > 0 else ""
    if plan.protocol_total > 0:
        records += f" and {result.protocol_removed} protocol records"
    click.echo(f"removed {result.removed} entries{records} (commit {result.commit_id})")


def _echo_prune_plan(plan: Any) -> str:
    """A prune plan's criteria and table of what it removes; returns what that is, in words."""
    from ficache.fingerprint import shown

    click.echo(f"prune plan ({', '.join(f'{k}={v}' for k, v in plan.criteria)}):")
    with_records = plan.records_total > 0
    with_protocol = plan.protocol_total > 0
    click.echo(
        _table(
            ["fingerprint", "gpu", "flashinfer", "scope", "entries"]
            + (["records"] if with_records else [])
            + (["protocol records"] if with_protocol else []),
            (
                (
                    g.fingerprint_id,
                    shown(g.gpu),
                    shown(g.flashinfer_version),
                    g.scope,
                    g.entries,
                )
                + ((g.records,) if with_records else ())
                + ((g.protocol_records,) if with_protocol else ())
                for g in plan.groups
            ),
        )
    )
    what = f"{plan.total} entries" + (f" and {plan.records_total} records" if with_records else "")
    if with_protocol:
        what += f" and {plan.protocol_total} protocol records"
    return what


#: ``revert`` lists this many conflicts in its plan (``--format json`` lists all).
REVERT_CONFLICTS_SHOWN = 10


@cli.command("revert")
@click.argument("commit_id", type=POSITIVE_ID, required=False)
@click.option(
    "--to",
    "to_commit",
    type=POSITIVE_ID,
    metavar="N",
    help="Return the registry to its state after commit N, as one new commit.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Show the plan and change nothing (exit 1 when the revert would be refused).",
)
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@FORMAT
@pass_ctx
def revert_cmd(
    obj: _Context, commit_id: int | None, to_commit: int | None, dry_run: bool, yes: bool, fmt: str
) -> None:
    """Undo one commit, or every commit after N (--to N), as a new commit.

    Reverting one commit is refused (exit 1, with --dry-run too) when the
    commit is already reverted or a later commit changed one of its entries
    or records and still holds it (a later change that was itself reverted
    is no conflict); the plan lists those conflicts and the commits that
    made them. --to N never refuses: every entry and record a later commit
    changed gets back the value it held after commit N; the later commits
    stay in the log, and the new commit can be reverted too.
    """
    from ficache.revert import plan_revert

    if (commit_id is None) == (to_commit is None):
        raise click.UsageError("give one COMMIT_ID to revert, or --to N")
    if to_commit is not None:
        _revert_to(obj, to_commit, dry_run, yes, fmt)
        return
    assert commit_id is not None
    with obj.registry(create=False) as reg:
        reg.require_writable()
        plan = plan_revert(reg, commit_id)
        if fmt == "json":
            if plan.refusal is None and not dry_run:
                _confirm_or_stop(f"Revert commit {commit_id}?", dry_run=False, yes=yes, err=True)
            result = None if plan.refusal is not None or dry_run else plan.execute(reg)
            _dump_json(
                {
                    **plan.as_json(),
                    "dry_run": dry_run,
                    "commit": result.commit_id if result is not None else None,
                }
            )
            plan.check()  # a refused plan: one error line, exit 1
            return
        _echo_revert_plan(plan)
        plan.check()
        _confirm_or_stop(f"Revert commit {commit_id}?", dry_run=dry_run, yes=yes)
        result = plan.execute(reg)
    records = (
        f"; records {result.records_removed} removed, {result.records_replaced} restored, "
        f"{result.records_added} re-added"
        if result.records_changed
        else ""
    )
    if result.protocol_changed:
        records += (
            f"; protocol records {result.protocol_removed} removed, {result.protocol_replaced} "
            f"restored, {result.protocol_added} re-added"
        )
    click.echo(
        f"reverted commit {commit_id} as commit {result.commit_id}: {result.removed} removed, "
        f"{result.replaced} restored, {result.added} re-added{records}"
    )


def _run_plan_as_json(reg: Any, plan: Any, question: str, *, dry_run: bool, yes: bool) -> None:
    """A destructive command under ``--format json``: ask on stderr (unless ``--yes``, a
    dry run or an empty plan), execute, print the plan with the commit the run made."""
    if not plan.is_empty and not dry_run:
        _confirm_or_stop(question, dry_run=False, yes=yes, err=True)
    result = None if plan.is_empty or dry_run else plan.execute(reg)
    _dump_json(
        {
            **plan.as_json(),
            "dry_run": dry_run,
            "commit": result.commit_id if result is not None else None,
        }
    )


def _revert_to(obj: _Context, commit_id: int, dry_run: bool, yes: bool, fmt: str) -> None:
    """``revert --to N``: plan, show, stop on --dry-run, ask (or --yes), execute."""
    from ficache.revert import plan_revert_to

    with obj.registry(create=False) as reg:
        reg.require_writable()
        plan = plan_revert_to(reg, commit_id)
        question = f"Return the registry to its state after commit {commit_id}?"
        if fmt == "json":
            _run_plan_as_json(reg, plan, question, dry_run=dry_run, yes=yes)
            return
        c = plan.commit
        counts = [("entries", plan.entries), ("records", plan.records)]
        counts += [("protocol records", plan.protocol)] if plan.protocol.total else []
        click.echo(
            f"revert plan: back to commit {c.id} ({c.kind}, {_when(c.created_at)}, {c.host}), "
            f"undoing {len(plan.later)} later commit(s): "
            + "; ".join(
                f"{what}: remove {n.remove}, restore {n.restore}, re-add {n.re_add}"
                for what, n in counts
            )
        )
        if plan.is_empty:
            click.echo(f"nothing to revert: the registry holds its state after commit {c.id}")
            return
        _confirm_or_stop(question, dry_run=dry_run, yes=yes)
        result = plan.execute(reg)
    click.echo(
        f"reverted to commit {commit_id} as commit {result.commit_id}: {result.removed} removed, "
        f"{result.replaced} restored, {result.added} re-added"
        + (
            f"; records {result.records_removed} removed, {result.records_replaced} restored, "
            f"{result.records_added} re-added"
            if result.records_changed
            else ""
        )
        + (
            f"; protocol records {result.protocol_removed} removed, "
            f"{result.protocol_replaced} restored, {result.protocol_added} re-added"
            if result.protocol_changed
            else ""
        )
    )


def _echo_revert_plan(plan: Any) -> None:
    """A ``RevertPlan`` as text: its counts, then its conflicts (the first few)."""
    c, e, r = plan.commit, plan.entries, plan.records
    records = (
        f"; records: remove {r.remove} added, restore {r.restore} replaced, "
        f"restore {r.re_add} removed"
        if r.total
        else ""
    )
    p = plan.protocol
    if p.total:
        records += (
            f"; protocol records: remove {p.remove} added, restore {p.restore} replaced, "
            f"restore {p.re_add} removed"
        )
    click.echo(
        f"revert plan: commit {c.id} ({c.kind}, {_when(c.created_at)}, {c.host}): "
        f"remove {e.remove} added, restore {e.restore} replaced, restore {e.re_add} removed"
        + records
    )
    if not plan.conflicts:
        return
    with_records = any(x.namespace is not None for x in plan.conflicts)
    shown = plan.conflicts[:REVERT_CONFLICTS_SHOWN]
    later = plan.changed_by
    by = f" (changed by commit{'s' if len(later) > 1 else ''} {', '.join(map(str, later))})"
    click.echo(f"conflicts{by if later else ''}:")
    click.echo(
        _table(
            ["kind", "fingerprint", "scope"]
            + (["namespace"] if with_records else [])
            + ["key", "commit did", "changed by"],
            (
                (x.kind, x.fingerprint_id, x.scope)
                + ((x.namespace,) if with_records else ())
                + (x.key, x.action, x.changed_by)
                for x in shown
            ),
        )
    )
    if len(plan.conflicts) > len(shown):
        click.echo(f"... and {len(plan.conflicts) - len(shown)} more (--format json lists all)")


@cli.command("fold")
@click.argument("source", metavar="SOURCE")
@click.option(
    "--into",
    "into",
    required=True,
    metavar="ID",
    help="The stored fingerprint (id or digest prefix) that takes SOURCE's entries and records.",
)
@click.option(
    "--keep-target",
    is_flag=True,
    help="Where both hold a key with different values, keep the target's [default: SOURCE's].",
)
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@FORMAT
@pass_ctx
def fold_cmd(
    obj: _Context, source: str, into: str, keep_target: bool, dry_run: bool, yes: bool, fmt: str
) -> None:
    """Fold fingerprint SOURCE into another of the same environment, as one commit.

    Every entry, record and protocol record of SOURCE moves to the
    fingerprint --into names (same scope and key), and SOURCE is left empty.
    Only fingerprints that can describe one environment fold (each field
    equal, or `*` on one side). `ficache revert` undoes it.
    """
    from ficache.fold import plan_fold
    from ficache.kinds import kind_named

    with obj.registry(create=False) as reg:
        reg.require_writable()
        plan = plan_fold(reg, source, into, keep_target=keep_target)
        question = f"Fold fingerprint {plan.source.id} into {plan.into.id}?"
        if fmt == "json":
            _run_plan_as_json(reg, plan, question, dry_run=dry_run, yes=yes)
            return
        click.echo(
            f"fold plan: fingerprint {plan.source.id} into {plan.into.id}: "
            + "; ".join(
                f"{kind_named(c.kind).plural}: move "
                f"{c.moved}, replace {c.replaced}, keep {c.kept}, same {c.same}"
                for c in plan.counts
                if c.total or c.kind == "entry"
            )
        )
        if plan.is_empty:
            click.echo(f"nothing to fold: fingerprint {plan.source.id} holds nothing")
            return
        _confirm_or_stop(question, dry_run=dry_run, yes=yes)
        result = plan.execute(reg)
    click.echo(
        f"folded fingerprint {plan.source.id} into {plan.into.id} as commit {result.commit_id}"
    )


#: ``verify`` shows this many problems of each kind (``--format json`` shows all).
VERIFY_EXAMPLES = 3


@cli.command("verify")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "text", "json"]),
    default="table",
    show_default=True,
    help="Output as a text report (`table`; `text` is the same) or as JSON.",
)
@pass_ctx
def verify_cmd(obj: _Context, fmt: str) -> None:
    """Check the registry (read-only): storage, schema, keys, history; exit 1 on problems."""
    from ficache.errors import FicacheError
    from ficache.verify import verify

    try:
        report = verify(obj.db)
    except FicacheError as exc:
        if fmt != "json":
            raise
        # JSON always: a registry verify cannot open is reported as what it is, on
        # stdout; stderr still carries the one error line every failing command prints.
        _dump_json({"registry": obj.db, "ok": False, "error": str(exc)})
        _fail(str(exc))
    if fmt == "json":
        _dump_json(report.as_json())
        sys.exit(0 if report.ok else 1)
    click.echo(
        f"registry {report.location} ({report.backend}, schema {report.revision or '(none)'}), "
        "checked read-only"
    )
    if report.checked is not None:
        n = report.checked
        records = (
            f", {n.records} records, {n.record_changes} record changes"
            if n.records or n.record_changes
            else ""
        )
        click.echo(
            f"checked {n.fingerprints} fingerprints, {n.entries} entries, {n.commits} commits, "
            f"{n.changes} changes{records}"
        )
    for note in report.notes:
        click.echo(f"note: {note}")
    if report.ok:
        click.echo("ok: no problems")
        return
    found = len(report.problems)
    click.echo(f"{found} problem{'s' if found != 1 else ''}:")
    for kind, count in report.counts:
        click.echo(f"{kind}: {count}")
        for problem in report.examples(kind, VERIFY_EXAMPLES):
            click.echo(f"  {problem.message}")
        if count > VERIFY_EXAMPLES:
            click.echo(f"  ... and {count - VERIFY_EXAMPLES} more")
    sys.exit(1)


@cli.command("env")
@FORMAT
@pass_ctx
def env_cmd(obj: _Context, fmt: str) -> None:
    """Show what ficache uses here: the registry, variables in effect, the slice cache.

    Reads only: a registry that does not exist is not created, one that
    cannot be read is reported with the reason.
    """
    from ficache.env_report import collect

    report = collect(obj.db)
    if fmt == "json":
        _dump_json(report.as_json())
        return
    if report.registry_problem is not None:
        schema_text = report.registry_problem
    elif report.registry_revision == report.head_revision:
        schema_text = f"schema {report.registry_revision} (head)"
    else:
        schema_text = f"schema {report.registry_revision or '(none)'}, head {report.head_revision}"
    size = f"{report.slice_cache_bytes / 1024:.1f} KiB"
    versions = ", ".join(f"{n} {v}" for n, v in report.versions.items() if v is not None)
    click.echo(
        _table(
            ["", ""],
            [
                ["registry", f"{report.registry} ({report.registry_source}; {schema_text})"],
                ["slice cache", f"{report.slice_cache} ({report.slice_cache_files} files, {size})"],
                ["versions", versions],
            ],
        )
    )
    click.echo()
    click.echo(
        _table(
            ["variable", "value", "effect"],
            [
                [v.name, "(unset)" if v.value is None else v.value, v.effect]
                for v in report.variables
            ],
        )
    )


# -- the startup protocol --------------------------------------------------------


@cli.command("demo")
@click.option(
    "--world",
    type=click.IntRange(min=1),
    default=None,
    help="Ranks to run (default: one per GPU, else 2 CPU ranks).",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cuda", "cpu"]),
    default="auto",
    show_default=True,
    help="GPUs with FlashInfer's real tuning, or CPU ranks with the labelled stand-in.",
)
@FORMAT
@pass_ctx
def demo_cmd(obj: _Context, world: int | None, device: str, fmt: str) -> None:
    """Two consecutive warm starts on N local processes against a registry.

    On a fresh registry the first start tunes and commits; the second loads
    everything and tunes nothing. Without --db (or FICACHE_DB) the demo uses a
    registry of its own, demo.db beside the default registry, never the one
    servers start from.
    """
    from ficache.demo import render_table, run_demo

    result = run_demo(world, obj.db, device=device)
    if fmt == "json":
        _dump_json(result)
    else:
        click.echo(render_table(result))


# -- schema -------------------------------------------------------------------


@cli.group("db", cls=_Group)
def db_group() -> None:
    """Schema revisions of the registry (Alembic)."""


@db_group.command("current")
@pass_ctx
def db_current(obj: _Context) -> None:
    """Print the registry's schema revision and this ficache's head."""
    with obj.registry_schema(create=False) as target:
        at = target.revision()
    click.echo(f"{at.revision or '(none)'} (head {at.head}: {at.state})")


@db_group.command("history")
@FORMAT
def db_history(fmt: str) -> None:
    """List the schema revisions this ficache knows, oldest first.

    For each: the ficache release whose head it is (as --version numbers
    releases), and the releases that read and write a registry at that
    revision as it is (during a rolling upgrade, without `db upgrade`).
    """
    from ficache import schema

    table = schema.revision_table()
    if fmt == "json":
        _dump_json([r.as_json() for r in table])
        return
    click.echo(
        _table(
            ["revision", "release", "read by", "written by", "title"],
            (
                (r.revision, r.release, ", ".join(r.read_by), ", ".join(r.written_by), r.title)
                for r in table
            ),
        )
    )


@db_group.command("upgrade")
@click.argument("revision", default="head")
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--sql",
    is_flag=True,
    help="Print the SQL the upgrade runs (Alembic's offline mode) and change nothing.",
)
@pass_ctx
def db_upgrade(obj: _Context, revision: str, dry_run: bool, yes: bool, sql: bool) -> None:
    """Upgrade (or create) the registry's schema to REVISION (default head).

    The plan names each revision applied and the ficache releases that then
    stop writing (and reading) the registry. On a registry servers share
    (PostgreSQL) it asks before stopping any; upgrade once every server runs a
    release that writes the new revision (see README, "Upgrading a fleet").
    """
    with obj.registry_schema(create=not (dry_run or sql)) as target:
        plan = target.plan_upgrade(revision)
        if sql:
            click.echo(target.upgrade_sql(plan), nl=False)
            return
        if not plan.steps:
            click.echo(f"registry {target.location.display} is at {plan.current}")
            return
        if plan.current is not None or dry_run:
            _show_upgrade_plan(plan)
        if plan.asks or dry_run:
            _confirm_or_stop(f"Upgrade to {plan.target}?", dry_run=dry_run, yes=yes)
        target.upgrade_planned(plan)
    click.echo(f"registry {target.location.display} is at {plan.target}")


def _show_upgrade_plan(plan: Any) -> None:
    """An upgrade plan: each revision applied, then whom it stops (``schema.UpgradePlan``)."""
    from ficache import schema

    start = plan.current or "(no schema)"
    click.echo(f"upgrade plan: {plan.location.display} from {start} to {plan.target}")
    for revision, title in plan.steps:
        click.echo(f"  {revision}: {title}")
    for head in plan.stop_writing:
        release = schema.release_of(head)
        if head in plan.stop_reading:
            effect = "stops reading and writing it: its warm starts tune uncached"
        else:
            effect = "stops writing it: its warm starts still serve, and commit nothing"
        click.echo(f"{release} (schema {head}) {effect}")
    if plan.stop_writing:
        click.echo(
            "upgrade once every server that shares this registry runs a ficache that "
            f"writes {plan.target} ({schema.release_of(plan.target)} or newer)"
        )


@db_group.command("downgrade")
@click.argument("revision")
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def db_downgrade(obj: _Context, revision: str, dry_run: bool, yes: bool) -> None:
    """Downgrade the schema to REVISION (`base` drops every table and entry).

    The plan lists each revision undone and what it drops, counted from the
    registry; upgrading again does not bring dropped data back.
    """
    with obj.registry_schema(create=False) as target:
        plan = target.plan_downgrade(revision)
        click.echo(
            f"downgrade plan: {target.location.display} from {plan.current} to {revision}"
            + (" (drops all stored entries)" if revision == "base" else "")
        )
        for step in plan.steps:
            click.echo(f"  {step.revision} -> {step.down_revision or 'base'}: {step.lost_str}")
        if plan.loses_data:
            click.echo("upgrading again does not bring back what a step drops")
        _confirm_or_stop(f"Downgrade to {revision}?", dry_run=dry_run, yes=yes)
        target.downgrade(plan)
    click.echo(f"registry {target.location.display} is at {revision}")


def main(argv: Sequence[str] | None = None) -> None:
    cli.main(args=list(argv) if argv is not None else None, prog_name="ficache")
