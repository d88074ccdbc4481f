"""Where a call's time goes, from a py-spy ``--format raw`` profile of benchmarks/profile_create.py.

Reads the collapsed stacks (one line per stack: frames joined by ``;``, then a sample count),
keeps the samples taken inside the timed loop (a frame of ``profile_create.py``'s call
lambda), and attributes each to the layer of its innermost frame that is not the standard
library's: the service's own code (``orders/``), SQLAlchemy, redis-py (with hiredis), the
SQL driver (sqlite3, psycopg) and the socket or commit it waits on. Prints one Markdown row
of percentages, so the flame graphs of docs/profiles/ come with their sums:

    .venv/bin/py-spy record --idle --format raw -o /tmp/pay.txt -- \\
        .venv/bin/python benchmarks/profile_create.py --engine sqlite --mode pay --ops 4000
    .venv/bin/python benchmarks/profile_shares.py /tmp/pay.txt

With ``--idle`` the samples count wall time (waits included), as the bench's ops/s do.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

#: Layers, in the order they are tested against a frame (the first that matches wins). A
#: frame reads ``function (path:line)``, the path relative to its entry of sys.path. The
#: SQL driver's C calls (execute, commit: the server's work and the waits for it) show as
#: the SQLAlchemy frames that make them, and Redis's replies as redis-py's socket reads.
LAYERS = (
    ("SQL driver and server", ("do_execute (", "do_commit (", "do_executemany (", "(psycopg")),
    ("Redis socket and server", ("read_from_socket (", "send_packed_command (")),
    ("SQLAlchemy", ("(sqlalchemy/",)),
    ("redis-py", ("(redis/", "(hiredis")),
    ("orders", ("(orders/",)),
)
#: A frame of the timed loop (profile_create.py's call of the use case).
LOOP = "<lambda> (profile_create.py:"


def layer_of(stack: list[str]) -> str:
    """The first layer (in :data:`LAYERS` order) that a frame of the stack belongs to,
    innermost first within a layer; else "other" (the standard library, the loop itself)."""
    for name, marks in LAYERS:
        if any(mark in frame for frame in stack for mark in marks):
            return name
    return "other"


def shares(text: str) -> tuple[Counter[str], int]:
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not count.isdigit() or LOOP not in stack_text:
            continue
        stack = stack_text.split(";")
        loop_at = max(i for i, frame in enumerate(stack) if LOOP in frame)
        counts[layer_of(stack[loop_at + 1 :])] += int(count)
    return counts, sum(counts.values())


def main(paths: list[str]) -> None:
    names = [name for name, _marks in LAYERS] + ["other"]
    print("| profile | samples | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for path in paths:
        counts, total = shares(Path(path).read_text())
        cells = [f"{100 * counts[name] / max(1, total):.0f} %" for name in names]
        print(f"| {Path(path).stem} | {total:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
