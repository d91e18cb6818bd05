"""Every tutorial runs end to end on tiny settings (PYRO_SUBSPACE_TINY=1)."""

import os
import shutil
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


@pytest.mark.slow
def test_tutorial_command_works_from_an_installed_wheel(tmp_path):
    """Build the wheel from a copy of the sources, install it into a fresh folder and run
    ``pyro-subspace tutorial 04`` (which also needs the shipped benchmark helpers) outside any
    checkout."""
    root = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, src / name)
    for name in ("pyro_subspace", "tutorials", "benchmarks"):
        shutil.copytree(
            root / name,
            src / name,
            symlinks=True,
            ignore=shutil.ignore_patterns("__pycache__", "results"),
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"), "."]
    subprocess.run(build, cwd=src, check=True, capture_output=True, timeout=600)
    wheel = next((tmp_path / "w").glob("*.whl"))
    site = tmp_path / "site"
    subprocess.run(
        [*pip, "install", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    run = tmp_path / "elsewhere"
    run.mkdir()
    env = {
        **os.environ,
        "PYRO_SUBSPACE_TINY": "1",
        "PYRO_SUBSPACE_OUT": str(run),
        "PYTHONPATH": str(site),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pyro_subspace.cli", "tutorial", "04"],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(site / "pyro_subspace" / "tutorials") in proc.stdout
    assert list(run.glob("*.png"))
