"""A problem found in a config, and the report both commands print."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    key: str
    message: str
    fatal: bool = True

    def __str__(self) -> str:
        return f"{'ERROR' if self.fatal else 'warning'}: {self.key}: {self.message}"


def format_report(problems: list[Problem]) -> str:
    if not problems:
        return "config OK for the zero-mismatch algorithms"
    fatal = sum(p.fatal for p in problems)
    lines = [str(p) for p in problems]
    lines.append(f"{fatal} error(s), {len(problems) - fatal} warning(s)")
    return "\n".join(lines)
