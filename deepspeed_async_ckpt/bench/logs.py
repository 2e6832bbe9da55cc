"""Closing lines of the logs a device check leaves: pytest's summary, the demo's table."""

from __future__ import annotations

import re

PYTEST_SUMMARY = re.compile(r"^=*\s*\d+ (passed|failed|errors?|skipped|deselected)\b.* in [\d.]+s")
"""pytest's closing line: ``=== 10 passed, 246 deselected in 8.87s ===`` with ``-v``, and
without the rules with ``-q`` (the host tests' run prints it so)."""


def pytest_summary(path: str) -> str | None:
    """The last closing line of the pytest run logged in ``path``, stripped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if PYTEST_SUMMARY.match(ln.strip())]
    except OSError:
        return None
    return lines[-1] if lines else None


def tail_line(path: str, startswith: str) -> str | None:
    """The last line of ``path`` that starts with ``startswith`` (pytest's and the demo's
    closing lines), stripped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip().startswith(startswith)]
    except OSError:
        return None
    return lines[-1] if lines else None
