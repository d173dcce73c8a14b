"""The ``ficache`` command line: a thin layer over the library.

Invariants:
- Each command opens the registry, calls the library, prints. Decisions
  (what to prune, what an export holds) are made in the library.
- Exit codes: 0 success, 1 error (one line on stderr, ``error: ...``; the
  traceback only with ``--debug``), 2 usage (click's own).
- Destructive commands (``prune``, ``revert``, ``db downgrade``) build a plan,
  print it, stop on ``--dry-run``, ask unless ``--yes``, then execute.
- Read-only commands never create a registry.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from ficache import __version__
from ficache.errors import FicacheError, NotFoundError

FORMAT = click.option(
    "--format",
    "fmt",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
    help="Output as an aligned table or as JSON.",
)


class _Context:
    def __init__(self, db: str | None, debug: bool) -> None:
        self.db = db
        self.debug = debug

    def registry(self, *, create: bool = True) -> Any:
        from ficache.registry import Registry

        return Registry.open(self.db, create=create)


def _fail(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(1)


class _Group(click.Group):
    """Maps library errors to one line and exit code 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except FicacheError as exc:
            if _debug(ctx):
                raise
            _fail(str(exc))
        except (click.exceptions.Exit, click.ClickException, click.Abort):
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
            _fail(f"unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)")


def _debug(ctx: click.Context) -> bool:
    obj = ctx.find_object(_Context)
    return bool(obj and obj.debug) or "--debug" in sys.argv


pass_ctx = click.make_pass_decorator(_Context)


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = [[str(h) for h in headers]] if any(headers) else []  # all-empty headers: no header line
    cells = head + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _dump_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_AGE_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class AgeType(click.ParamType):
    name = "AGE"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        m = _AGE.match(str(value))
        if not m:
            self.fail(f"{value!r} is not an age like 30d, 12h, 90m, 2w", param, ctx)
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


def _confirm_or_stop(question: str, *, dry_run: bool, yes: bool) -> None:
    if dry_run:
        click.echo("dry run: nothing changed")
        sys.exit(0)
    if yes:
        return
    if not sys.stdin.isatty():
        _fail("refusing to change the registry without confirmation; pass --yes")
    if not click.confirm(question, default=False):
        click.echo("aborted: nothing changed")
        sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--db",
    envvar="FICACHE_DB",
    metavar="PATH_OR_URL",
    help="Registry: a SQLite path or SQLAlchemy URL [env FICACHE_DB; default: the user cache dir].",
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
@FORMAT
@pass_ctx
def fingerprints_cmd(obj: _Context, fmt: str) -> None:
    """List stored fingerprints with their entry counts."""
    with obj.registry(create=False) as reg:
        infos = reg.fingerprints()
    if fmt == "json":
        _dump_json([i.as_json() for i in infos])
        return
    from ficache.fingerprint import ALL_FIELDS

    click.echo(
        _table(
            ["id", "entries", "digest", *ALL_FIELDS],
            [
                (i.id, i.entries, i.fingerprint.short_digest, *i.fingerprint.as_dict().values())
                for i in infos
            ],
        )
    )


# -- import / export -----------------------------------------------------------


@cli.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
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
@FORMAT
@pass_ctx
def import_cmd(
    obj: _Context, files: tuple[Path, ...], fingerprint_ref: str | None, scope: str, fmt: str
) -> None:
    """Import FlashInfer autotune cache files, all of them as one commit.

    Every file is read and validated first: one invalid file imports nothing.
    """
    from ficache.flashinfer_format import read_cache_file

    parsed = [(str(f), read_cache_file(f)) for f in files]
    with obj.registry() as reg:
        fp = _resolve_fingerprint(reg, fingerprint_ref) if fingerprint_ref else None
        result = reg.import_cache(parsed, fingerprint=fp, scope=scope)
    total = sum(len(c.entries) for _, c in parsed)
    ignored_records = sum(len(c.records or {}) for _, c in parsed)
    if fmt == "json":
        _dump_json(
            {
                "files": len(parsed),
                "entries": total,
                "commit": result.commit_id,
                "added": result.added,
                "replaced": result.replaced,
                "unchanged": result.unchanged,
                "ignored_record_namespaces": ignored_records,
            }
        )
    else:
        where = (
            f"commit {result.commit_id}"
            if result.commit_id is not None
            else "nothing new, no commit"
        )
        click.echo(
            f"imported {total} entries from {len(parsed)} file(s): {result.added} added, "
            f"{result.replaced} replaced, {result.unchanged} unchanged ({where})"
        )
    if ignored_records:
        click.echo(
            f"warning: {ignored_records} _records namespace(s) were not imported "
            "(ficache stores tactics only)",
            err=True,
        )


@cli.command("export")
@click.option(
    "--fingerprint",
    "fingerprint_ref",
    required=True,
    metavar="ID|current",
    help="A stored fingerprint id, or `current` for what this environment would load.",
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
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the cache file here (atomically) instead of stdout.",
)
@pass_ctx
def export_cmd(obj: _Context, fingerprint_ref: str, scope: str, output: Path | None) -> None:
    """Export a FlashInfer cache file that AutoTuner.load_configs accepts."""
    from ficache.flashinfer_format import write_atomic

    with obj.registry(create=False) as reg:
        if fingerprint_ref == "current":
            from ficache.fingerprint import collect

            text, count = reg.export_for(collect(), scope=scope)
        else:
            text, count = reg.export_text(reg.fingerprint(fingerprint_ref).id, scope=scope)
    if output is None:
        click.echo(text, nl=False)
        return
    try:
        write_atomic(output, text)
    except OSError as exc:
        _fail(f"cannot write {output}: {exc.strerror}")
    click.echo(f"wrote {count} entries to {output}", err=True)


# -- inspection ---------------------------------------------------------------


@cli.command("list")
@click.option("--op", help="Only entries of this custom op.")
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
@click.option("--limit", type=click.IntRange(min=1), help="Show at most this many entries.")
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
    fmt: str,
) -> None:
    """List stored entries."""
    with obj.registry(create=False) as reg:
        ids = [reg.fingerprint(fingerprint_ref).id] if fingerprint_ref else None
        rows = reg.entries(
            fingerprint_ids=ids,
            op=op,
            gpu=gpu,
            flashinfer_version=flashinfer_version,
            scope=scope,
            limit=limit,
        )
        if fmt == "json":
            click.echo("[", nl=False)
            for i, entry in enumerate(rows):
                click.echo(("," if i else "") + "\n  " + json.dumps(entry.as_json()), nl=False)
            click.echo("\n]")
            return
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


@cli.command("stats")
@FORMAT
@pass_ctx
def stats_cmd(obj: _Context, fmt: str) -> None:
    """Summarise the registry: fingerprints, entries, ops, commits."""
    with obj.registry(create=False) as reg:
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
            ],
        )
    )
    if stats.ops:
        click.echo()
        click.echo(_table(["op", "entries"], stats.ops))


@cli.command("log")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=20,
    show_default=True,
    help="Show at most this many commits, newest first.",
)
@FORMAT
@pass_ctx
def log_cmd(obj: _Context, limit: int, fmt: str) -> None:
    """Show the newest commits with their provenance."""
    with obj.registry(create=False) as reg:
        commits = reg.log(limit)
    if fmt == "json":
        _dump_json([c.as_json() for c in commits])
        return
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
                    c.world_size,
                    c.layout,
                    (c.message or "")[:60],
                )
                for c in commits
            ),
        )
    )


# -- destructive ----------------------------------------------------------------


@cli.command("prune")
@click.option(
    "--fingerprint",
    "fingerprint_refs",
    multiple=True,
    metavar="ID",
    help="Remove the entries of this stored fingerprint (repeatable).",
)
@click.option(
    "--flashinfer-version",
    "versions",
    multiple=True,
    metavar="VERSION",
    help="Remove entries of fingerprints with this FlashInfer version (repeatable).",
)
@click.option(
    "--older-than", type=AgeType(), help="Remove entries last written before this age (30d, 12h)."
)
@click.option("--scope", callback=_check_scope, help="Remove only entries of this scope.")
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def prune_cmd(
    obj: _Context,
    fingerprint_refs: tuple[str, ...],
    versions: tuple[str, ...],
    older_than: float | None,
    scope: str | None,
    dry_run: bool,
    yes: bool,
) -> None:
    """Remove entries matching all given criteria, as one revertible commit."""
    with obj.registry(create=False) as reg:
        reg.require_writable()
        ids = [reg.fingerprint(ref).id for ref in fingerprint_refs]
        try:
            plan = reg.plan_prune(
                fingerprint_ids=ids,
                flashinfer_versions=versions,
                older_than_seconds=older_than,
                scope=scope,
            )
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
        if plan.is_empty:
            click.echo("nothing matches: nothing to prune")
            return
        click.echo(f"prune plan ({', '.join(f'{k}={v}' for k, v in plan.criteria)}):")
        click.echo(
            _table(
                ["fingerprint", "gpu", "flashinfer", "scope", "entries"],
                (
                    (g.fingerprint_id, g.gpu, g.flashinfer_version, g.scope, g.entries)
                    for g in plan.groups
                ),
            )
        )
        click.echo(f"{plan.total} entries would be removed (revertible with `ficache revert`)")
        _confirm_or_stop(f"Remove {plan.total} entries?", dry_run=dry_run, yes=yes)
        result = plan.execute(reg)
    click.echo(f"removed {result.removed} entries (commit {result.commit_id})")


@cli.command("revert")
@click.argument("commit_id", type=click.IntRange(min=1))
@click.option("--dry-run", is_flag=True, help="Show what would be reverted and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def revert_cmd(obj: _Context, commit_id: int, dry_run: bool, yes: bool) -> None:
    """Undo one commit as a new commit (refused if later commits changed its entries)."""
    with obj.registry(create=False) as reg:
        reg.require_writable()
        found = reg.log(None, commit_id=commit_id)
        if not found:
            raise NotFoundError(f"no commit {commit_id}; see `ficache log`")
        c = found[0]
        click.echo(
            f"revert plan: commit {c.id} ({c.kind}, {_when(c.created_at)}, {c.host}): "
            f"remove {c.added} added, restore {c.replaced} replaced, restore {c.removed} removed"
        )
        _confirm_or_stop(f"Revert commit {c.id}?", dry_run=dry_run, yes=yes)
        result = reg.revert(commit_id)
    click.echo(
        f"reverted commit {commit_id} as commit {result.commit_id}: {result.removed} removed, "
        f"{result.replaced} restored, {result.added} re-added"
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
    """Two consecutive warm starts on N local processes against the registry.

    On a fresh registry the first start tunes and commits; the second loads
    everything and tunes nothing.
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


def _schema_engine(obj: _Context, *, create: bool) -> tuple[Any, Any]:
    from ficache import schema

    location = schema.resolve(obj.db)
    engine, _readonly = schema.make_engine(location, create=create)
    return location, engine


@db_group.command("current")
@pass_ctx
def db_current(obj: _Context) -> None:
    """Print the registry's schema revision and this ficache's head."""
    from ficache import schema

    location, engine = _schema_engine(obj, create=False)
    try:
        with engine.connect() as conn:
            revision = schema.check_revision(conn, location)
    finally:
        engine.dispose()
    head = schema.head_revision()
    state = "up to date" if revision == head else ("empty" if revision is None else "needs upgrade")
    click.echo(f"{revision or '(none)'} (head {head}: {state})")


@db_group.command("history")
def db_history() -> None:
    """List the schema revisions this ficache knows, oldest first."""
    from ficache import schema

    click.echo(_table(["revision", "down", "title"], schema.history()))


@db_group.command("upgrade")
@click.argument("revision", default="head")
@pass_ctx
def db_upgrade(obj: _Context, revision: str) -> None:
    """Upgrade (or create) the registry's schema to REVISION (default head)."""
    from ficache import schema

    location, engine = _schema_engine(obj, create=True)
    try:
        schema.upgrade(engine, location, revision)
        with engine.connect() as conn:
            now = schema.current_revision(conn)
    finally:
        engine.dispose()
    click.echo(f"registry {location.display} is at {now}")


@db_group.command("downgrade")
@click.argument("revision")
@click.option("--dry-run", is_flag=True, help="Show the plan and change nothing.")
@click.option("-y", "--yes", is_flag=True, help="Do not ask for confirmation.")
@pass_ctx
def db_downgrade(obj: _Context, revision: str, dry_run: bool, yes: bool) -> None:
    """Downgrade the schema to REVISION (`base` drops every table and entry)."""
    from ficache import schema

    location, engine = _schema_engine(obj, create=False)
    try:
        with engine.connect() as conn:
            current = schema.check_revision(conn, location)
        click.echo(
            f"downgrade plan: {location.display} from {current} to {revision}"
            + (" (drops all stored entries)" if revision == "base" else "")
        )
        _confirm_or_stop(f"Downgrade to {revision}?", dry_run=dry_run, yes=yes)
        schema.downgrade(engine, location, revision)
    finally:
        engine.dispose()
    click.echo(f"registry {location.display} is at {revision}")


def main(argv: Sequence[str] | None = None) -> None:
    cli.main(args=list(argv) if argv is not None else None, prog_name="ficache")
