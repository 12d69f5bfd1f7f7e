"""Every shell command the docs mark runnable runs as written, so a documented command cannot rot.

The marker is an HTML comment line starting ``<!-- runnable`` right before a code block (indented
or fenced; blank lines may separate them); MkDocs does not render it. Each line of the block is one
command, run with bash from a scratch folder that holds the repository's ``configs/`` and
``launch/`` and a ``.venv`` (this interpreter's environment), in document order, so a later command
reads what an earlier one wrote (``runs/quickstart``). Install steps in a ``&&`` chain
(``python3 -m venv``, ``pip install``) are skipped. Training commands (``megaformer train``,
``launch/torchrun.sh``) get ``MEGAFORMER_DOC_OVERRIDES`` appended (default :data:`TINY_RUN`: a
two-step run of a small model), to run in seconds; set it to an empty string to run the documented
sizes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, subprocess_env

MARKER = "<!-- runnable"
TINY_RUN = (
    "model.n_layers=1 model.d_model=32 model.n_heads=4 model.n_kv_heads=2 train.steps=2 "
    "data.max_bytes=200000 eval.interval=2 eval.iters=1 log.sample_tokens=8 "
    "log.progress_bar=false log.tensorboard=false"
)
SKIPPED = re.compile(r"^(python3? -m venv|\S*pip3? install)\b")
TRAINING = re.compile(r"megaformer train\b|torchrun\.sh\b")


def runnable_commands(markdown: str) -> list[str]:
    """The commands of the code blocks that follow a runnable marker, in order."""
    lines = markdown.split("\n")
    commands: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith(MARKER):
            i += 1
            continue
        i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i < len(lines) and lines[i].lstrip().startswith("```"):
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                commands.append(lines[i].strip())
                i += 1
        else:
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                if lines[i].strip():
                    commands.append(lines[i].strip())
                i += 1
    return [c for c in (_without_install(c) for c in commands) if c]


def _without_install(command: str) -> str:
    return " && ".join(p for p in (p.strip() for p in command.split("&&")) if not SKIPPED.match(p))


def with_overrides(command: str, overrides: str) -> str:
    """``command`` with the run-size overrides appended when it trains."""
    return f"{command} {overrides}" if overrides and TRAINING.search(command) else command


def _pages() -> list[Path]:
    return sorted(
        p for p in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"] if MARKER in p.read_text()
    )


def test_marked_blocks_are_read():
    text = (
        "intro\n\n<!-- runnable -->\n\n    python3 -m venv .venv && .venv/bin/pip install -e . "
        "&& .venv/bin/megaformer train c.yaml\n    megaformer report runs/x\n\nprose\n\n"
        "    megaformer train not-marked.yaml\n\n<!-- runnable: note -->\n```bash\nls configs\n```\n"
    )
    assert runnable_commands(text) == [
        ".venv/bin/megaformer train c.yaml",
        "megaformer report runs/x",
        "ls configs",
    ]
    assert with_overrides("launch/torchrun.sh 2 c.yaml", "a=1") == "launch/torchrun.sh 2 c.yaml a=1"
    assert with_overrides(".venv/bin/megaformer generate runs/x", "a=1") == (
        ".venv/bin/megaformer generate runs/x"
    )
    assert "getting-started.md" in [p.name for p in _pages()]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_documented_commands_run(page, tmp_path):
    for name in ("configs", "launch"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    overrides = os.environ.get("MEGAFORMER_DOC_OVERRIDES", TINY_RUN)
    env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHON", None)  # the launchers find ./.venv as they would in a clone
    for command in runnable_commands(page.read_text()):
        run = with_overrides(command, overrides)
        proc = subprocess.run(
            ["bash", "-c", run], cwd=tmp_path, env=env, text=True, capture_output=True, timeout=900
        )
        assert proc.returncode == 0, f"{page.name}: `{run}` exited {proc.returncode}:\n" + (
            proc.stdout[-2000:] + proc.stderr[-3000:]
        )
