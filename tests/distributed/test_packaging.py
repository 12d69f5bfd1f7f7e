"""The wheel: it holds every module and data file under megaformer/, and installed outside the source
tree (no editable install, no PYTHONPATH) `megaformer train CONFIG --dry-run` works."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow


def _source_files() -> set[str]:
    """Every file under megaformer/ a wheel must carry (modules and package data), as wheel paths."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "megaformer").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
    }


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel .`` of a copy of the source tree (the build writes build/ and *.egg-info next to
    setup.py: never into the working tree)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "megaformer",
        src / "megaformer",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        cwd=src,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("megaformer-*.whl")
    return whl


def test_wheel_holds_every_module_and_data_file(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    packaged = {n for n in names if n.startswith("megaformer/")}
    expected = _source_files()
    assert "megaformer/kernels/cpu_native.c" in expected
    assert "megaformer/parallel/__init__.py" in expected
    assert sorted(expected - packaged) == [], "missing from the wheel"
    assert sorted(packaged - expected) == [], "in the wheel but not in the source tree"
    entry = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert len(entry) == 1
    assert "megaformer = megaformer.cli:main" in zipfile.ZipFile(wheel).read(entry[0]).decode()


def test_installed_wheel_runs_a_dry_run_outside_the_source_tree(wheel, tmp_path):
    """A fresh venv gets the wheel; the project venv's dependencies (torch, DeepSpeed, ...) come
    from a plain path entry, which does not run that venv's editable-install hook, so the
    ``megaformer`` imported is the installed one."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    deps = sysconfig.get_paths()["purelib"]  # this interpreter's site-packages
    (site / "project_dependencies.pth").write_text(deps + "\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            str(wheel),
        ],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy2(ROOT / "configs" / "quickstart.yaml", work / "quickstart.yaml")
    modules = sorted(
        ".".join(Path(f).with_suffix("").parts).removesuffix(".__init__")
        for f in _source_files()
        if f.endswith(".py") and not f.endswith("__main__.py")
    )
    check = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    assert importlib.import_module(name).__file__.startswith(sys.prefix), name\n"
        "print(len(sys.argv) - 1)"
    )
    imported = subprocess.run(
        [str(python), "-c", check, *modules],
        cwd=work,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert imported.returncode == 0, imported.stderr[-3000:]  # every module, from the venv
    assert imported.stdout.split() == [str(len(modules))]
    proc = subprocess.run(
        [str(venv / "bin" / "megaformer"), "train", "quickstart.yaml", "--dry-run"],
        cwd=work,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert re.search(r"^# parameters: [\d,]+ total", proc.stdout, re.M), proc.stdout[-2000:]
    assert not (work / "runs").exists()  # a dry run writes nothing
