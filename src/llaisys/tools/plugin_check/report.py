"""The check's report: its rows (pass, fallback, fail, skip) and how they print."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

PASS, FALLBACK, FAIL, SKIP = "pass", "fallback", "fail", "skip"


@dataclass
class CheckRow:
    """One line of the report."""

    name: str
    status: str
    detail: str = ""


ROW_WIDTH = 24  # the check-name column


def format_row(row: CheckRow) -> str:
    """One table line; the detail on one line."""
    return f"  {row.name:<{ROW_WIDTH}}  {row.status:<8}  {' '.join(row.detail.split())}"


@dataclass
class CheckReport:
    """What ``run_check`` found for the library at ``path``. ``on_row`` sees each row as it
    is added (the command prints them as they come). ``hung`` names the plugin API that did
    not return within the row timeout, if one did not."""

    path: str
    rows: list[CheckRow] = field(default_factory=list)
    on_row: Callable[[CheckRow], None] | None = field(default=None, repr=False)
    hung: str | None = None

    def add(self, name: str, status: str, detail: str = "") -> None:
        """Append a row."""
        row = CheckRow(name, status, detail)
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(row)

    def fail(self, name: str, detail: str) -> None:
        """Append a failed row."""
        self.add(name, FAIL, detail)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return all(r.status != FAIL for r in self.rows)

    def header(self) -> str:
        """The lines above the rows."""
        return f"plugin check: {self.path}\n  {'check':<{ROW_WIDTH}}  {'result':<8}  detail"

    def summary(self) -> str:
        """The line below the rows: OK or FAILED, and the count of each result."""
        counts = {s: sum(r.status == s for r in self.rows) for s in (PASS, FALLBACK, FAIL, SKIP)}
        return f"{'OK' if self.ok else 'FAILED'}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)

    def table(self) -> str:
        """Header, rows and summary as text."""
        return "\n".join([self.header(), *map(format_row, self.rows), self.summary()])


class Skip(Exception):
    """The row cannot run on this device; the message says why."""


class Hung(Exception):
    """A call into the plugin did not return in time; ``api`` names it."""

    def __init__(self, api: str, timeout: float):
        super().__init__(f"{api} did not return within {timeout:g} s")
        self.api = api
