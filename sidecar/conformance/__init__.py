"""``openengine-conformance``: protocol checks against a live OpenEngine v0.1.0 server.

An operator bringing an engine runs ``openengine-conformance --engine HOST:PORT`` before production: one line per
check (pass / variant / fail / skip, with the evidence), then ``N passed, N failed, N skipped``; exit 0 only when
nothing failed. Each check states the rule it tests and cites it by topic: the OpenEngine v0.1.0 contract
(``wire §…``) or TensorRT-LLM's server behaviour (``trtllm §…``); ``docs/conformance.md`` lists the topics.

A standalone asyncio program, like ``openengine-mock``: it drives the engine with grpclib directly so that it sees the
raw wire. Production code never imports it.
"""

from ._cli import main as main
from ._context import KitConfig as KitConfig
from ._model import CheckResult as CheckResult
from ._model import Outcome as Outcome
from ._model import Report as Report
from ._model import Verdict as Verdict
from ._registry import Check as Check
from ._runner import GROUPS as GROUPS
from ._runner import Unreachable as Unreachable
from ._runner import run as run
from ._runner import selected_checks as selected_checks
from ._wire import Observation as Observation
from ._wire import Target as Target
from ._wire import generate as generate

__all__ = [
    "GROUPS",
    "Check",
    "CheckResult",
    "KitConfig",
    "Observation",
    "Outcome",
    "Report",
    "Target",
    "Unreachable",
    "Verdict",
    "generate",
    "main",
    "run",
    "selected_checks",
]
