"""The one result type of a health check (``fd-rr doctor`` and the backends' doctor hooks).

A backend's ``rdma_check`` and ``doctor_checks`` return a :class:`Check`, the doctor
itself builds them, and its report prints them: one form from the hook to the screen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["FAIL", "OK", "SKIP", "WARN", "Check", "Status"]


class Status(enum.StrEnum):
    """How a check ended; ``fail`` makes ``fd-rr doctor`` exit non-zero."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


OK, WARN, FAIL, SKIP = Status.OK, Status.WARN, Status.FAIL, Status.SKIP


@dataclass
class Check:
    """The outcome of one check: its name, status, a one-line summary and detail lines."""

    name: str
    status: Status
    summary: str
    details: list[str] = field(default_factory=list)
    elapsed_ms: float = 0.0

    def __post_init__(self) -> None:
        try:
            self.status = Status(self.status)
        except ValueError:
            raise ValueError(f"check {self.name!r} has status {self.status!r}; expected one "
                             f"of {', '.join(s.value for s in Status)}") from None
