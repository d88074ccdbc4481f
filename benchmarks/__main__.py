"""``python -m benchmarks``: the lab's command (:mod:`benchmarks.cli`)."""

from benchmarks.cli import bench

bench(prog_name="python -m benchmarks")
