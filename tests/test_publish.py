"""``ficache.publish.publish``, the one way ficache writes a file a user asked for,
on real files in ``tmp_path``: what is at the path decides how it is written
(regular file or new path: atomic replace; device or FIFO: written to;
symlink: followed; socket, directory, loop: refused), modes follow the umask
for new files and are kept for replaced ones, and a failure leaves the old
file byte for byte with no temp file behind.

The CLI cases (``export -o``, ``--bundle``, ``--v2-store``) are in
test_cli.py, test_bundle.py and test_v2_store.py."""

from __future__ import annotations

import errno
import os
import resource
import socket
import stat
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import pytest

from ficache.publish import publish


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    ("mask", "expected"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)], ids=oct
)
def test_a_new_file_follows_the_umask(tmp_path: Path, umask, mask: int, expected: int) -> None:
    target = tmp_path / "new" / "file.json"
    umask(mask)

    publish(target, "x")

    assert (target.read_text(), mode(target)) == ("x", expected)


@pytest.mark.parametrize("kept", [0o644, 0o640, 0o604, 0o600], ids=oct)
def test_a_replaced_file_keeps_its_mode_whatever_the_umask(
    tmp_path: Path, umask, kept: int
) -> None:
    target = tmp_path / "file.json"
    target.write_text("old")
    target.chmod(kept)
    umask(0o077 if kept & 0o044 else 0o022)

    publish(target, "new")

    assert (target.read_text(), mode(target)) == ("new", kept)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file away needs root")
def test_a_replaced_file_keeps_its_owner_and_group(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    target.write_text("old")
    os.chown(target, 12345, 23456)

    publish(target, "new")

    st = target.stat()
    assert (target.read_text(), st.st_uid, st.st_gid) == ("new", 12345, 23456)


def test_a_symlink_chain_is_followed_and_stays(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    real = tmp_path / "real" / "file.json"
    real.write_text("old")
    real.chmod(0o640)
    middle = tmp_path / "middle"
    middle.symlink_to("real/file.json")  # relative, resolved from the link's directory
    outer = tmp_path / "outer"
    outer.symlink_to(middle)

    publish(outer, "new")

    assert (os.readlink(outer), os.readlink(middle)) == (str(middle), "real/file.json")
    assert (real.read_text(), mode(real)) == ("new", 0o640)
    assert sorted(os.listdir(real.parent)) == ["file.json"]


def test_a_dangling_symlink_creates_its_target(tmp_path: Path, umask) -> None:
    link = tmp_path / "link"
    link.symlink_to("made/here.json")
    umask(0o022)

    publish(link, "new")

    made = tmp_path / "made" / "here.json"
    assert (link.is_symlink(), os.readlink(link)) == (True, "made/here.json")
    assert (made.read_text(), mode(made)) == ("new", 0o644)


def test_a_fifo_is_written_to_and_stays_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open does not wait
    try:
        publish(fifo, b"through the pipe")
        got = os.read(reader, 1 << 16)
    finally:
        os.close(reader)

    assert got == b"through the pipe"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


def test_streams_false_refuses_a_fifo_and_leaves_it(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    with pytest.raises(OSError, match="not a regular file"):
        publish(fifo, "x", streams=False)  # never blocks: nothing opens the FIFO

    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["pipe"]


def test_a_socket_a_directory_and_a_loop_are_refused(tmp_path: Path) -> None:
    sock_path = tmp_path / "sock"
    with closing(socket.socket(socket.AF_UNIX)) as sock:
        sock.bind(str(sock_path))
        with pytest.raises(OSError, match="a socket"):
            publish(sock_path, "x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        publish(tmp_path / "dir", "x")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(OSError) as loop:
        publish(tmp_path / "a", "x")

    assert loop.value.errno == errno.ELOOP
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    assert (os.readlink(tmp_path / "a"), os.readlink(tmp_path / "b")) == ("b", "a")
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "dir", "sock"]
    assert os.listdir(tmp_path / "dir") == []


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past ``limit`` bytes fail with EFBIG, as on a disk that is full
    (Python ignores SIGXFSZ, so the write raises instead of killing the process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "file.json"
    target.write_bytes(b"old bytes")
    target.chmod(0o640)

    with file_size_limit(4096), pytest.raises(OSError) as failed:
        publish(target, b"n" * 65536)

    assert failed.value.errno == errno.EFBIG
    assert (target.read_bytes(), mode(target)) == (b"old bytes", 0o640)
    assert os.listdir(tmp_path) == ["file.json"]


def test_an_interrupt_before_the_rename_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection at the OS boundary: Ctrl-C arriving during the fsync."""
    target = tmp_path / "file.json"
    target.write_bytes(b"old bytes")

    def interrupted(_fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        publish(target, b"new bytes")

    assert target.read_bytes() == b"old bytes"
    assert os.listdir(tmp_path) == ["file.json"]
