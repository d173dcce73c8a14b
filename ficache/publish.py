"""Publishing a file a user asked for: one way every ficache writer puts bytes at a path.

``publish(path, data)`` writes ``data`` where ``path`` leads, the way a
careful Unix tool would. It is used by every writer of user-visible files
(``export -o``, ``export --bundle``, each file of ``export --v2-store``) and
by the slice cache.

Invariants:
- What is at ``path`` decides how it is written, never the other way round:
  - a regular file, or nothing (a new path), is replaced atomically: a temp
    file in the target's directory, written, fsynced (``durable``), then
    ``os.replace``; a reader sees the old file or the new one, never part of
    either. The temp file is removed on any failure, ``KeyboardInterrupt``
    included; the old file is then byte for byte as it was. Missing parent
    directories are created (mode from the umask).
  - a character or block device or a FIFO is written to (opened without
    creating or truncating it, streamed, closed); it stays what it was, so
    ``-o /dev/null`` discards and ``-o /dev/stdout`` or a named pipe streams.
  - a socket or a directory is refused with an ``OSError`` naming it, and
    so is a device or FIFO when the caller passes ``streams=False`` (a path
    ficache chose itself, such as the slice cache's).
- A symlink is followed, chains and dangling links included: the file it
  finally names is replaced (or created) atomically and the link stays a
  link, pointing where it did. A loop is refused (``ELOOP``).
- Modes: a new file gets what ``open()`` would give it (0666 less the umask,
  and a directory's default ACL); a replaced file keeps its permission bits
  and, where the process may set them, its owner and group. The temp file
  is never more open than the file it becomes: it is created with the final
  mode (or less, the umask applying), then set to exactly that mode before
  the rename.
- A replaced file is a new inode: hard links to the old one keep the old
  bytes, as with any atomic replace.
- ``-`` is not special here: it is an ordinary file name. Where the CLI
  offers ``-`` for standard output, the CLI writes to standard output itself.
- Errors are ``OSError`` with ``filename`` set; callers turn them into their
  own one-line ``FicacheError``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path

#: Kinds of existing file that are written to in place rather than replaced.
_STREAMED = (stat.S_ISCHR, stat.S_ISBLK, stat.S_ISFIFO)


def publish(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    durable: bool = True,
    streams: bool = True,
) -> None:
    """Put ``data`` (``str`` is UTF-8) where ``path`` leads; see the module docstring.

    ``durable``: fsync the temp file before the rename (for files users
    keep); a cache that may be lost passes False. ``streams``: write into a
    device or FIFO found at ``path``; a path ficache chose itself passes
    False, and anything but a regular file there is then refused, so a FIFO
    nobody reads can never block it.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    given = os.fspath(path)
    try:
        found = os.stat(given)  # follows links: what the path leads to
    except FileNotFoundError:
        found = None  # a new path, or a dangling link to one
    if found is not None and any(kind(found.st_mode) for kind in _STREAMED):
        if not streams:
            raise OSError(errno.EOPNOTSUPP, "not a regular file; not writing into it", given)
        # The path as given, not its resolution: /dev/stdout resolves through
        # /proc/self/fd to names that cannot be opened again.
        _stream(given, payload)
        return
    if found is not None and stat.S_ISDIR(found.st_mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), given)
    if found is not None and stat.S_ISSOCK(found.st_mode):
        raise OSError(errno.EOPNOTSUPP, "a socket, not a file ficache can write", given)
    target = os.path.realpath(given)
    if os.path.islink(target):  # realpath gives up on a loop and returns a link
        raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), given)
    _replace(Path(target), payload, found, durable=durable)


def _stream(path: str, payload: bytes) -> None:
    """Write ``payload`` into the device or FIFO at ``path``, leaving it in place."""
    fd = os.open(path, os.O_WRONLY | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _replace(
    target: Path, payload: bytes, existing: os.stat_result | None, *, durable: bool
) -> None:
    """Atomically replace (or create) the regular file ``target`` with ``payload``."""
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    mode = stat.S_IMODE(existing.st_mode) if existing is not None else 0o666
    fd, tmp = _create_temp(directory, target.name, mode)
    try:
        if existing is not None:
            if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
                # Only root (or a member of the group) may; otherwise the new
                # file is the writer's, as any rewrite by this user would be.
                with contextlib.suppress(PermissionError):
                    os.fchown(fd, existing.st_uid, existing.st_gid)
            os.fchmod(fd, mode)  # after chown, which may clear set-id bits
        with os.fdopen(fd, "wb") as handle:
            fd = -1  # the file object owns it now
            handle.write(payload)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _create_temp(directory: Path, name: str, mode: int) -> tuple[int, str]:
    """A new, hidden, uniquely named file in ``directory``, opened for writing.

    Created with ``mode`` so the kernel applies the umask (and default ACLs)
    to a new file exactly as ``open()`` would; ``tempfile.mkstemp`` would
    force 0600.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = os.fspath(directory / f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name", os.fspath(directory))
