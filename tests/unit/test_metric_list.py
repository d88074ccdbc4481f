"""Every metric is in the operator's table (docs/operations.md, Metrics), and the counted
resources' metrics keep a bounded set of series: their labels are a fixed list of values,
never a resource id (ids are unbounded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orders import metrics

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def metrics_table() -> str:
    """The Metrics section of docs/operations.md, up to the next heading."""
    text = OPERATIONS.read_text()
    start = text.index("\n## Metrics\n")
    return text[start : text.index("\n## ", start + 1)]


def exposed_name(name: str) -> str:
    """The name a scrape shows (a counter's with ``_total``)."""
    [described] = getattr(metrics, name).describe()
    return f"{described.name}_total" if described.type == "counter" else str(described.name)


@pytest.mark.parametrize("name", sorted(metrics.METRIC_NAMES))
def test_each_metric_is_in_the_operators_table(name: str) -> None:
    shown = exposed_name(name)
    assert f"`{shown}`" in metrics_table() or f"`{shown}{{" in metrics_table()


@pytest.mark.parametrize(
    ("name", "label", "values"),
    [
        ("HOLDS", "outcome", metrics.HOLD_OUTCOMES),
        ("RESOURCE_DRIFT", "kind", metrics.DRIFT_KINDS),
        ("WAITING", "outcome", metrics.WAITING_OUTCOMES),
    ],
)
def test_resource_metrics_have_one_label_of_listed_values_and_no_resource_label(
    name: str, label: str, values: tuple[str, ...]
) -> None:
    metric = getattr(metrics, name)
    row = next(line for line in metrics_table().splitlines() if f"`{exposed_name(name)}`" in line)
    for value in values:
        metric.labels(**{label: value})  # exactly this one label: no other is required
        assert value in row
    with pytest.raises(ValueError, match="label"):
        metric.labels(**{label: values[0], "resource_id": "sku:42"})
