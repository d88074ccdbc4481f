"""The Prometheus alert rules in docs/prometheus: valid, unit-tested, and about real metrics.

Prometheus' own ``promtool`` checks the rules file and runs its unit tests
(tests/prometheus/orders-alerts.test.yml: input series and the alerts expected of them), so
what is tested is what a Prometheus server would evaluate. Without promtool (Debian's
``prometheus`` package) these tests are skipped on a developer's machine and fail in CI.

A rule that queries a metric under a name orders does not export would never fire, and
promtool cannot tell: the names the expressions use are compared with those
``orders.metrics`` registers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus" / "orders-alerts.yml"
RULE_TESTS = ROOT / "tests" / "prometheus" / "orders-alerts.test.yml"

#: A series name of the service in a PromQL expression.
METRIC_NAME = re.compile(r"\borders_[a-z0-9_]*[a-z0-9]")
#: What prometheus-client adds to a family's name for its samples, by metric type.
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not found (Debian: apt-get install prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the alert rules must be checked in CI: {reason}")
        pytest.skip(reason)
    return path


def run_promtool(*args: str) -> str:
    done = subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} failed:\n{output}"
    return output


def test_promtool_check_rules_accepts_the_rules_file() -> None:
    assert "SUCCESS" in run_promtool("check", "rules", str(RULES))


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert "SUCCESS" in run_promtool("test", "rules", str(RULE_TESTS))


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    alerts = re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.MULTILINE)
    tests = RULE_TESTS.read_text()
    assert alerts
    for alert in alerts:
        head = rf"alertname: {alert}\n\s*exp_alerts:"
        assert re.search(head + r"\n\s*- exp_labels:", tests), f"no test where {alert} fires"
        assert re.search(head + r" \[\]", tests), f"no test where {alert} stays silent"


def expressions(rules_text: str) -> list[str]:
    """The text of each ``expr:``, inline or a block scalar (the lines indented under it)."""
    found: list[str] = []
    lines = rules_text.splitlines()
    for i, line in enumerate(lines):
        head = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if head is None:
            continue
        indent, inline = len(head[1]), head[2]
        if inline not in (">", ">-", "|", "|-"):
            found.append(inline)
            continue
        block = []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            block.append(following)
        found.append("\n".join(block))
    return found


def exported_names() -> set[str]:
    """Every sample name orders.metrics registers, read from the registry itself."""
    from prometheus_client import REGISTRY  # noqa: PLC0415

    from orders import metrics  # noqa: PLC0415

    metrics.register()
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        if family.name.startswith("orders_")
        for suffix in SAMPLE_SUFFIXES[family.type]
    }


def test_rules_query_only_metrics_orders_exports() -> None:
    exprs = expressions(RULES.read_text())
    assert len(exprs) == len(re.findall(r"^\s*- alert: ", RULES.read_text(), re.MULTILINE))
    # Each rule queries at least one orders metric: an expression read wrong has none.
    assert all(METRIC_NAME.search(expr) for expr in exprs), exprs
    used = {name for expr in exprs for name in METRIC_NAME.findall(expr)}
    assert used - exported_names() == set()
