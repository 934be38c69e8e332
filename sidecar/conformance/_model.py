"""What a check is and what it concludes: verdicts, outcomes, results, the run's report."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

__all__ = ["CheckResult", "FailCheck", "Outcome", "Report", "SkipCheck", "Verdict"]


class Verdict(enum.StrEnum):
    """How one check ended. ``variant`` is a known, accepted difference between implementations: it counts as passed."""

    PASS = "pass"
    VARIANT = "variant"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Outcome:
    """A check's conclusion and the evidence behind it (one line, what was sent and what came back)."""

    verdict: Verdict
    evidence: str

    @classmethod
    def passed(cls, evidence: str) -> Outcome:
        return cls(Verdict.PASS, evidence)

    @classmethod
    def variant(cls, evidence: str) -> Outcome:
        return cls(Verdict.VARIANT, evidence)

    @classmethod
    def failed(cls, evidence: str) -> Outcome:
        return cls(Verdict.FAIL, evidence)

    @classmethod
    def skipped(cls, evidence: str) -> Outcome:
        return cls(Verdict.SKIP, evidence)


class SkipCheck(Exception):
    """Raised inside a check: it cannot be judged here (not advertised, needs a flag, depends on a failed check)."""


class FailCheck(Exception):
    """Raised inside a check: the engine broke the rule; the message is the evidence."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One check's line in the report."""

    id: str
    rule: str
    cites: str
    verdict: Verdict
    evidence: str
    seconds: float

    def as_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "group": self.id.partition(".")[0],
            "rule": self.rule,
            "cites": self.cites,
            "verdict": self.verdict.value,
            "evidence": self.evidence,
            "seconds": round(self.seconds, 3),
        }


@dataclass(slots=True)
class Report:
    """Everything a run found: the engine it talked to and one result per check, in run order."""

    engine: str
    server: dict[str, object] = field(default_factory=dict)
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, *verdicts: Verdict) -> int:
        return sum(1 for r in self.results if r.verdict in verdicts)

    @property
    def passed(self) -> int:
        return self.count(Verdict.PASS, Verdict.VARIANT)

    @property
    def failed(self) -> int:
        return self.count(Verdict.FAIL)

    @property
    def skipped(self) -> int:
        return self.count(Verdict.SKIP)

    @property
    def variants(self) -> int:
        return self.count(Verdict.VARIANT)

    @property
    def ok(self) -> bool:
        return self.failed == 0

    def totals_line(self) -> str:
        line = f"{self.passed} passed, {self.failed} failed, {self.skipped} skipped"
        if self.variants:
            line += f" ({self.variants} of the passes are known variants)"
        return line

    def as_json(self) -> dict[str, object]:
        return {
            "engine": self.engine,
            "server": self.server,
            "checks": [r.as_json() for r in self.results],
            "totals": {
                "passed": self.passed,
                "failed": self.failed,
                "skipped": self.skipped,
                "variants": self.variants,
            },
            "seconds": round(self.seconds, 3),
            "ok": self.ok,
        }
