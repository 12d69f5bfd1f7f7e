"""The documentation site: ``mkdocs build --strict`` passes (no broken link or anchor, no page left out
of the navigation), and the configuration reference matches the config declarations."""

from __future__ import annotations

import importlib.util
import logging
import shutil
from pathlib import Path

import pytest

from tests.helpers import ROOT


def _config_docs():
    spec = importlib.util.spec_from_file_location("config_docs", ROOT / "tools" / "config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(root: Path, site: Path) -> None:
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    build(load_config(str(root / "mkdocs.yml"), site_dir=str(site), strict=True))


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("NO_MKDOCS_2_WARNING", "1")
    yield
    logging.getLogger("mkdocs").handlers.clear()


@pytest.mark.slow
def test_site_builds_strict(tmp_path):
    _build(ROOT, tmp_path / "site")
    for page in (
        "index",
        "configuration",
        "parallelism",
        "benchmarks",
        "troubleshooting",
        "security",
    ):
        assert (tmp_path / "site" / ("" if page == "index" else page) / "index.html").is_file(), (
            page
        )


@pytest.mark.slow
@pytest.mark.parametrize("breakage", ["broken link", "page not in nav", "broken anchor"])
def test_strict_build_fails_on_a_broken_site(tmp_path, breakage):
    from mkdocs.exceptions import Abort

    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy2(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "faults.md"
    if breakage == "broken link":
        page.write_text(page.read_text() + "\nSee [nothing](no-such-page.md).\n")
    elif breakage == "page not in nav":
        (copy / "docs" / "orphan.md").write_text("# Orphan\n")
    else:
        page.write_text(page.read_text() + "\nSee [data](data.md#no-such-section).\n")
    with pytest.raises(Abort):
        _build(copy, tmp_path / "site")


def test_configuration_page_is_up_to_date(capsys):
    mod = _config_docs()
    assert mod.main(["--check"]) == 0, capsys.readouterr().out
    text = mod.PAGE.read_text()
    from megaformer.config import describe_keys

    missing = [key for key, *_ in describe_keys() if f"| `{key}` |" not in text]
    assert not missing, f"docs/configuration.md lacks config keys: {missing}"
    # a stale table is detected
    stale = text.replace("| `train.steps` |", "| `train.stepz` |")
    assert stale != text and mod.updated(stale) == text
