"""ficache.demo.run_demo on real gloo ranks (CPU stand-in where there is no GPU per rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ficache.demo import PROFILING_CPU, demo_registry_path, render_table, run_demo
from ficache.errors import FicacheError


@pytest.mark.slow
def test_demo_on_a_fresh_registry_tunes_then_loads_everything(tmp_path: Path) -> None:
    """With no registry named, the demo uses its own (demo.db beside the default
    registry, which it never creates), and its cold commit is not called a warm start."""
    from ficache.location import default_registry_path
    from ficache.registry import Registry

    db = demo_registry_path()
    assert db.parent == default_registry_path().parent and db.name == "demo.db"
    assert str(db).startswith(str(tmp_path))  # the test's user cache dir (conftest)
    result = run_demo(2, device="cpu", timeout=300)
    assert not default_registry_path().exists()
    json.dumps(result)
    assert result["profiling"] == PROFILING_CPU
    first, second = result["starts"]
    assert (first["rank"], first["world_size"], first["registry"]) == (0, 2, str(db))
    assert (first["status"], first["tuned"], first["committed"], first["commit_id"]) == (
        "cold",
        18,
        18,
        1,
    )
    assert first["disagreements"] == 0
    assert (second["status"], second["loaded"], second["tuned"], second["committed"]) == (
        "warm",
        18,
        0,
        0,
    )
    with Registry.open(str(db), create=False, write=False) as reg:
        (commit,) = reg.log()
    assert commit.message == "startup on 2 rank(s) (world2): 18 keys tuned"
    table = render_table(result)
    assert "CPU stand-in" in table and "cold" in table and "warm" in table
    assert table.splitlines()[4].split() == [
        "start",
        "status",
        "loaded",
        "tuned",
        "committed",
        "commit",
        "disagreements",
        "seconds",
    ]


def test_demo_rejects_bad_arguments() -> None:
    with pytest.raises(FicacheError, match="--device"):
        run_demo(2, device="tpu")
    with pytest.raises(FicacheError, match="--world"):
        run_demo(0, device="cpu")
