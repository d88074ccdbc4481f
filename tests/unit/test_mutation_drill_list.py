"""The mutation drill's list still matches the code: every fragment it breaks occurs exactly
once in its file, and every test file it names exists.

The drill itself (``scripts/mutation_drill.py``) runs on demand, not here; this only checks
its list, the way the drill does before it starts, so that a change which moves or rewrites
a fragment fails at once instead of at the next drill.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"


def test_every_mutation_of_the_drill_finds_its_fragment_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The drill imports its lists as top-level modules from scripts/, as this does.
    monkeypatch.syspath_prepend(str(SCRIPTS))
    lists = importlib.import_module("drill_mutations")
    mutations = importlib.import_module("drill_mutations_processes").MUTATIONS
    assert len(mutations) > 50  # the whole list, the three parts joined

    problems = lists.check_mutations(list(mutations), REPO)

    assert problems == [], (
        "the mutation drill's list no longer matches the code: update these mutations in "
        "scripts/drill_mutations*.py so that each breaks the same rule where it lives now "
        "(then run scripts/mutation_drill.py --only <names>):\n" + "\n".join(problems)
    )
