"""Past ficache releases from this checkout's git history, to run beside this one (tests only).

- ``commit_adding(revision)``: the commit that added ``migrations/versions/REVISION.py``
  (None without that history, e.g. a shallow clone); the release whose head is the
  revision before it is that commit's parent.
- ``release_tree(commit, into)``: ``ficache`` and ``migrations`` at ``commit``, laid out
  as its wheel installs them (migrations inside the package), so that release finds its
  own ``ficache.migrations`` first: an editable install of this tree (``pip install -e
  .``) adds a finder that would otherwise serve this tree's migrations to it. Run it with
  ``PYTHONPATH=into`` and ``python -m ficache``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def commit_adding(revision: str) -> str | None:
    try:
        added = subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "log",
                "--diff-filter=A",
                "--format=%H",
                "--",
                f"migrations/versions/{revision}.py",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    return added[-1] if added else None


def release_tree(commit: str, into: Path) -> Path:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", commit, "ficache", "migrations"],
        capture_output=True,
        check=True,
    ).stdout
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    shutil.copytree(into / "migrations", into / "ficache" / "migrations")
    return into
