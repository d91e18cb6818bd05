"""Every tutorial runs end to end on tiny settings (PYRO_SUBSPACE_TINY=1)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parents[1] / "tutorials").glob("[0-9]*.py"))


@pytest.mark.parametrize("script", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(script, tmp_path):
    env = {**os.environ, "PYRO_SUBSPACE_TINY": "1", "PYRO_SUBSPACE_OUT": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    pngs = list(tmp_path.glob("*.png"))
    assert pngs and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


def test_there_is_a_tutorial():
    assert len(TUTORIALS) >= 1
