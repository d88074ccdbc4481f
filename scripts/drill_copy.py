"""The mutation drill's temporary copy of the checkout, and the environment its tests run in
(the runner is ``scripts/mutation_drill.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(*args: str) -> str:
    exe = shutil.which("git")
    if exe is None:
        raise SystemExit("mutation drill: git not found")
    done = subprocess.run([exe, "-C", str(REPO), *args], capture_output=True, text=True, check=True)
    return done.stdout


def copy_checkout(target: Path) -> None:
    """The checkout's files as they are on disk (tracked, and untracked but not ignored)."""
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    for name in sorted({n for n in listed if n}):
        source = REPO / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the working tree
        dest = target / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            os.symlink(os.readlink(source), dest)
        else:
            shutil.copy2(source, dest)


def child_env(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(copy), env.get("PYTHONPATH")) if p)
    # Never a stale .pyc: a mutation and its undo can keep a file's size and mtime second.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("PYTEST_ADDOPTS", None)
    env["COLUMNS"] = "400"  # the short summary keeps the failure's reason on its line
    return env


def check_imports(copy: Path) -> None:
    """Python in the copy must import ``orders`` (and its Lua) and ``tests`` from the copy."""
    probe = (
        "import importlib.resources, orders, tests.support.processes\n"
        "print(orders.__file__)\n"
        "print(importlib.resources.files('orders.index').joinpath('lua', 'admit.lua'))\n"
        "print(tests.support.processes.REPO / 'tests')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=copy,
        env=child_env(copy),
        capture_output=True,
        text=True,
        check=False,
    )
    paths = done.stdout.split()
    real = copy.resolve()
    if done.returncode != 0 or len(paths) != 3:
        raise SystemExit(f"mutation drill: cannot import from the copy:\n{done.stderr}")
    for path in paths:
        if not Path(path).resolve().is_relative_to(real):
            raise SystemExit(
                f"mutation drill: {path} is imported from outside the copy {copy}; "
                "the mutations would not be tested"
            )
