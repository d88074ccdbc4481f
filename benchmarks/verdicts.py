"""A target's verdict: the measured figure, the bound it is held to, and pass or miss."""

from __future__ import annotations

from typing import Any


def check(
    key: str, name: str, measured: float, op: str, required: float, unit: str, note: str = ""
) -> dict[str, Any]:
    """One target of the report (its ``targets`` list, benchmarks/README.md)."""
    ok = {">=": measured >= required, "<=": measured <= required, "==": measured == required}
    return {
        "id": key,
        "name": name,
        "measured": float(measured),
        "op": op,
        "required": float(required),
        "unit": unit,
        "verdict": "pass" if ok[op] else "miss",
        "note": note,
    }
