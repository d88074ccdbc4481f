"""Mutation drill: break each rule that matters with a one-line change, and see a test fail.

Run on demand, not in CI (a full run takes a few minutes):

    .venv/bin/python scripts/mutation_drill.py            # every mutation, writes the results
    .venv/bin/python scripts/mutation_drill.py --list     # names, places and test selections
    .venv/bin/python scripts/mutation_drill.py --only admit-limit-off-by-one,sql-guard-dropped

Each mutation names a file, an exact fragment of it, its replacement, and the tests that must
catch it. The fragment must occur exactly once in the file as it stands: when the code moves,
the drill refuses to run and says which mutations to update, instead of quietly testing
nothing.

The working tree is never written to (but for the results file, at the end). The drill copies
the checkout's files (``git ls-files``: tracked, plus untracked files not ignored, so a test
being written takes part) into a temporary folder and runs pytest there with that copy first
on PYTHONPATH. The editable install points at the checkout, so before anything else the drill
checks that the copy is what Python imports, then applies a sanity mutation that must fail.
A baseline run of every selected test, unmutated, must pass: a failure that happens anyway
proves nothing about a mutation. Each mutation is applied, its tests run
(``-x -q -p no:cacheprovider``, with a time limit), and the original text is put back. The
temporary folder is removed at the end, also after Ctrl-C or SIGTERM.

Exit status: 0 when every mutation was caught, 1 when one survived (or timed out, or its
tests could not run), 2 when the drill could not start (a fragment not found once, a failing
baseline, tests that do not import the copy).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import ClassVar

from drill_copy import REPO, check_imports, child_env, copy_checkout
from drill_mutations import SANITY, Mutation, check_mutations
from drill_mutations_processes import MUTATIONS
from drill_report import Outcome, print_list, report_line, write_markdown

DEFAULT_MARKDOWN = Path("docs/mutation-drill.md")
#: How long one mutation's tests may run before the drill stops them (pytest's own per-test
#: timeout, 120 s, normally fires first).
DEFAULT_TIMEOUT_S = 300.0
#: After SIGINT, how long pytest gets to run its finalizers (stop its servers) before SIGKILL.
INTERRUPT_GRACE_S = 20.0
PYTEST_FLAGS = ("-x", "-q", "-p", "no:cacheprovider")
#: How many failed node ids a result keeps.
FAILED_SHOWN = 3


# --- running pytest ----------------------------------------------------------------------------


_FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S.*?)(?: - (.*))?$", re.MULTILINE)


class Runner:
    """Runs pytest in one copy; keeps track of the child so an interrupt can stop it."""

    children: ClassVar[set[subprocess.Popen[str]]] = set()
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, copy: Path, timeout_s: float) -> None:
        self.copy = copy
        self.timeout_s = timeout_s
        self.env = child_env(copy)

    def pytest(self, args: Sequence[str]) -> tuple[int | None, str, float]:
        """(exit status or None on timeout, output, seconds)."""
        basetemp = self.copy.parent / f"{self.copy.name}-pytest"
        command = [
            sys.executable, "-m", "pytest", *PYTEST_FLAGS, f"--basetemp={basetemp}", *args
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(
            command,
            cwd=self.copy,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: an interrupt stops all of it
        )
        with Runner.lock:
            Runner.children.add(proc)
        try:
            try:
                output, _ = proc.communicate(timeout=self.timeout_s)
                status: int | None = proc.returncode
            except subprocess.TimeoutExpired:
                stop_group(proc)
                output, _ = proc.communicate()
                status = None
        finally:
            with Runner.lock:
                Runner.children.discard(proc)
        return status, output, time.monotonic() - started

    @classmethod
    def stop_all(cls) -> None:
        with cls.lock:
            running = list(cls.children)
        for proc in running:
            stop_group(proc)


def stop_group(proc: subprocess.Popen[str]) -> None:
    """Stop a pytest we started and its children: SIGINT (finalizers run), then SIGKILL."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(INTERRUPT_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def failed_tests(output: str) -> list[str]:
    found = []
    for node, reason in _FAILED_LINE.findall(output):
        why = " ".join(reason.split())[:100]
        found.append(f"{node} ({why})" if why else node)
    return found


@contextmanager
def mutated(copy: Path, m: Mutation) -> Iterator[None]:
    """The copy with ``m`` applied; the original text is back afterwards."""
    path = copy / m.path
    original = path.read_text("utf-8")
    if original.count(m.original) != 1:
        raise RuntimeError(f"{m.name}: the copy's {m.path} does not match the checkout")
    path.write_text(original.replace(m.original, m.replacement), "utf-8")
    try:
        yield
    finally:
        path.write_text(original, "utf-8")


def run_mutation(runner: Runner, m: Mutation) -> Outcome:
    with mutated(runner.copy, m):
        status, output, seconds = runner.pytest(m.tests)
    failed = failed_tests(output)
    if status is None:
        verdict = "timeout"
    elif status == 0:
        verdict = "survived"
    elif status == 1 and failed:
        verdict = "caught"
    else:  # 2 interrupted or collection error, 3 internal error, 4 usage, 5 nothing collected
        verdict = "error"
    return Outcome(m, verdict, seconds, failed[:FAILED_SHOWN], output)


def baseline_selections(mutations: Sequence[Mutation]) -> list[tuple[str, ...]]:
    """The selected tests as few pytest runs: node ids together, each ``-k`` run alone."""
    plain: dict[str, None] = {}
    keyed: dict[tuple[str, ...], None] = {}
    for m in mutations:
        if "-k" in m.tests:
            keyed[m.tests] = None
        else:
            plain.update(dict.fromkeys(m.tests))
    return ([tuple(plain)] if plain else []) + list(keyed)


def run_baseline(runner: Runner, mutations: Sequence[Mutation]) -> Outcome:
    """Every selected test, unmutated: they must pass for a failure to mean anything."""
    total = 0.0
    for args in baseline_selections(mutations):
        status, output, seconds = runner.pytest(args)
        total += seconds
        if status != 0:
            verdict = "timeout" if status is None else f"failed (exit {status})"
            return Outcome(None, verdict, total, failed_tests(output), output)
    return Outcome(None, "passed", total)


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--only", help="comma-separated mutation names (the sanity one runs too)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    parser.add_argument(
        "--markdown",
        type=Path,
        help=f"results file (default {DEFAULT_MARKDOWN}; written by full runs, or when given)",
    )
    parser.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutation's tests"
    )
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of the selected tests"
    )
    return parser.parse_args(argv)


def select(only: str | None) -> list[Mutation]:
    if not only:
        return list(MUTATIONS)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {m.name for m in MUTATIONS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"mutation drill: no mutation named {', '.join(unknown)} (see --list)")
    return [m for m in MUTATIONS if m.sanity or m.name in names]


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def prepare(mutations: Sequence[Mutation], args: argparse.Namespace, temp: Path) -> list[Runner]:
    """One copy per job; checks that the copy is imported and that the sanity mutation fails."""
    copies = []
    for n in range(max(1, args.jobs)):
        copy = temp / f"copy-{n}"
        copy_checkout(copy)
        copies.append(copy)
    check_imports(copies[0])
    return [Runner(copy, args.timeout) for copy in copies]


def run_all(runners: Sequence[Runner], mutations: Sequence[Mutation]) -> dict[str, Outcome]:
    """Each mutation on the first free copy; results by name, printed as they come."""
    outcomes: dict[str, Outcome] = {}
    free = list(runners)
    free_lock = threading.Lock()

    def job(m: Mutation) -> Outcome:
        with free_lock:
            runner = free.pop()
        try:
            return run_mutation(runner, m)
        finally:
            with free_lock:
                free.append(runner)

    with ThreadPoolExecutor(max_workers=len(runners)) as pool:
        futures = [pool.submit(job, m) for m in mutations]
        try:
            for done, future in enumerate(as_completed(futures), start=1):
                outcome = future.result()
                assert outcome.mutation is not None
                outcomes[outcome.mutation.name] = outcome
                print(report_line(done, len(mutations), outcome), flush=True)
        except BaseException:
            for future in futures:
                future.cancel()
            Runner.stop_all()
            raise
    return outcomes


def summarize(ordered: Sequence[Outcome], wall_s: float) -> list[Outcome]:
    """Print the totals and every mutation not caught; returns those."""
    bad = [o for o in ordered if o.status != "caught"]
    print(f"\n{len(ordered) - len(bad)} of {len(ordered)} mutations caught in {wall_s:.0f} s")
    for o in bad:
        assert o.mutation is not None
        print(f"  {o.status}: {o.mutation.name} ({' '.join(o.mutation.tests)})")
        if o.status != "survived":
            print(o.output[-2000:])
    return bad


def drill(mutations: list[Mutation], args: argparse.Namespace, temp: Path) -> int:
    started_at = datetime.now(UTC)
    started = time.monotonic()
    runners = prepare(mutations, args, temp)
    print(f"mutation drill: {len(mutations) - 1} mutations, copies in {temp}", flush=True)
    sanity = run_mutation(runners[0], SANITY)
    print(report_line(0, len(mutations) - 1, sanity), flush=True)
    if sanity.status != "caught":
        print(sanity.output[-3000:], file=sys.stderr)
        print("mutation drill: the sanity mutation was not caught: the tests do not run the "
              "mutated copy", file=sys.stderr)  # fmt: skip
        return 2
    rest = [m for m in mutations if not m.sanity]
    baseline = Outcome(None, "skipped", 0.0)
    if not args.no_baseline:
        baseline = run_baseline(runners[0], rest)
        print(f"baseline: {baseline.status} in {baseline.seconds:.1f} s", flush=True)
        if baseline.status != "passed":
            print(baseline.output[-5000:], file=sys.stderr)
            print("mutation drill: the selected tests fail without any mutation", file=sys.stderr)
            return 2
    outcomes = run_all(runners, rest)
    ordered = [outcomes[m.name] for m in rest]
    wall_s = time.monotonic() - started
    bad = summarize(ordered, wall_s)
    markdown = args.markdown or (None if args.only else DEFAULT_MARKDOWN)
    if markdown is not None:
        target = markdown if markdown.is_absolute() else REPO / markdown
        write_markdown(target, [sanity, *ordered], baseline, started_at, wall_s)
        print(f"results written to {target}")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    mutations = select(args.only)
    problems = check_mutations(mutations, REPO)
    if problems:
        print("mutation drill: the list does not match the source:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
        return 2
    if args.list:
        print_list(mutations)
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    temp = Path(tempfile.mkdtemp(prefix="orders-mutation-drill-"))
    try:
        return drill(mutations, args, temp)
    except KeyboardInterrupt:
        Runner.stop_all()
        print("\nmutation drill: interrupted; the working tree is untouched", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
