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


def test_every_package_of_the_source_tree_is_in_the_distribution() -> None:
    """setuptools installs only the packages pyproject lists: a subpackage left out (the CLI,
    say) exists in an editable install and is missing from a real one."""
    with (REPO / "pyproject.toml").open("rb") as file:
        listed = set(tomllib.load(file)["tool"]["setuptools"]["packages"])
    source = REPO / "orders"
    found = {
        ".".join(("orders", *init.parent.relative_to(source).parts))
        for init in source.rglob("__init__.py")
        if "__pycache__" not in init.parts and init.parent.name != "_migrations"
    }
    assert found - {"orders._migrations.versions"} <= listed
