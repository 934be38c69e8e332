"""What a start leaves behind (issue 36 §3).

Dynamo's logging setup (``dynamo.runtime.logging.configure_dynamo_logging``, run when ``dynamo.frontend`` is
imported, and by ``python -m dynamo.trtllm.sidecar``) writes SGLang's logging configuration to a new
``$TMPDIR/tmp*.json`` on every start and never removes it; ``DYN_SKIP_SGLANG_LOG_FORMATTING=1`` skips it (nothing here
runs SGLang). The test environment (``tests.helpers.processes.base_env``) and the launchers (``launch/_common.sh``)
set it; this worker never runs that setup at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.deploy.test_launchers import run_sourcing
from tests.helpers.processes import DynamoEnv, start_frontend
from tests.helpers.stack import start_engine, start_sidecar

pytestmark = pytest.mark.e2e

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def _residue(denv: DynamoEnv) -> list[str]:
    return sorted(p.name for p in Path(denv.env["TMPDIR"]).glob("tmp*.json"))


async def test_a_frontend_and_a_worker_start_leave_no_sglang_log_config(dynamo_env: DynamoEnv) -> None:
    with trio.fail_after(120):
        async with (
            start_frontend(dynamo_env),
            start_engine(dynamo_env, "--speedup", "0") as engine,
            start_sidecar(dynamo_env, engine.address),
        ):
            assert _residue(dynamo_env) == []
        assert _residue(dynamo_env) == []


def test_the_launchers_set_the_variable(tmp_path: Path) -> None:
    """Every launcher sources ``launch/_common.sh`` (``tests/deploy/test_launchers.py`` runs them)."""
    done = run_sourcing(
        f'. "{LAUNCH / "_common.sh"}" && printf %s "$DYN_SKIP_SGLANG_LOG_FORMATTING"', tmp_path, check=True
    )
    assert done.stdout == "1", done
