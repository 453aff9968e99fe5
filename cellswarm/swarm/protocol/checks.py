"""A doctor's line: what `cellswarm doctor` prints and what the coordinator's checkup round
sends back over the API for each node (one frozen value, both ends)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    step: str  # input, environment, request
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str
    fix: str = ""
    node: str = ""  # the node a line is about (doctor --coordinator), else ""

    def line(self) -> str:
        tail = f" — fix: {self.fix}" if self.fix else ""
        return f"{self.status:<4} {self.step:<11} {self.name:<22} {self.detail}{tail}"
