"""What a user sees of the distribution: version, licence, changelog."""

from __future__ import annotations

import tomllib
from importlib.metadata import metadata, version
from pathlib import Path

import orders

REPO = Path(__file__).resolve().parents[2]


def pyproject() -> dict[str, object]:
    with (REPO / "pyproject.toml").open("rb") as file:
        project: dict[str, object] = tomllib.load(file)["project"]
    return project


def test_version_is_the_installed_distributions() -> None:
    assert orders.__version__ == version("orders")
    assert orders.__version__ == pyproject()["version"]


def test_the_license_file_is_the_declared_license() -> None:
    assert pyproject()["license"] == "MIT"
    assert metadata("orders")["License-Expression"] == "MIT"
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the orders authors\n")


def test_the_changelog_has_an_entry_for_this_version() -> None:
    text = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text
    assert f"## [{orders.__version__}] - " in text
