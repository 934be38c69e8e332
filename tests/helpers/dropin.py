"""What the tests of the drop-in (issue 36 §1) share: this worker started with exactly the arguments Dynamo's own
sidecar would get, a Hugging Face cache holding the tiny model under a hub id, a Dynamo client for the worker's
endpoints, and the prompt the engine received as text.

Same rules as :mod:`tests.helpers.processes`: loopback only, bounded waits, every process killed by whoever started it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from tokenizers import Tokenizer

from .processes import DynamoEnv, free_low_port, start_process
from .stack import MODEL_DIR, Worker, mock_stats

#: This worker's command, as the manifests name it (``openengine-sidecar`` is ``sidecar.cli:main``).
OURS = [sys.executable, "-m", "sidecar"]
#: The worker's log line once it serves (``worker registering -> serving``).
SERVING = "worker registering -> serving"


def cache_model(denv: DynamoEnv, model_id: str, source: Path = MODEL_DIR) -> Path:
    """Put ``source``'s files into the environment's Hugging Face cache as ``model_id``'s snapshot, in the hub's
    cache layout (``hub/models--org--name/{refs/main, snapshots/<revision>/}``): Dynamo then resolves ``model_id``
    offline (``HF_HUB_OFFLINE=1``, as every test environment sets) as it would after a download."""
    repo = Path(denv.env["HF_HOME"]) / "hub" / ("models--" + model_id.replace("/", "--"))
    revision = hashlib.sha1(model_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file():
            shutil.copy(path, snapshot / path.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@asynccontextmanager
async def start_ours(
    denv: DynamoEnv,
    args: Sequence[str],
    *,
    name: str,
    env: dict[str, str] | None = None,
    ready: str | None = SERVING,
    ready_timeout: float = 60.0,
) -> AsyncIterator[Worker]:
    """``openengine-sidecar`` with exactly ``args`` (nothing added but Dynamo's inner system port, pinned below 32768
    as every test pins it) and the loopback test environment plus ``env``; yields once it serves (``ready``)."""
    system_port = free_low_port()
    environment = denv.worker_env(DYN_SYSTEM_PORT=str(system_port), **(env or {}))
    argv = [*OURS, *args, "--dynamo-system-port", str(free_low_port())]
    async with start_process(
        argv, environment, log_path=denv.log_path(name), ready=ready, ready_timeout=ready_timeout, stop_grace=10.0
    ) as process:
        yield Worker(process, system_port)


_CALL = """
import asyncio, json, sys
from dynamo.runtime import DistributedRuntime

async def main():
    path, plane, bodies = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", response_plane=plane)
    client = await runtime.endpoint(path).client()
    await asyncio.wait_for(client.wait_for_instances(), 20)
    answers = []
    for body in bodies:
        async for item in await client.generate(body):
            answers.append(item.data() if hasattr(item, "data") else item)
    print(json.dumps(answers))
    runtime.shutdown()

asyncio.run(main())
"""


async def call_endpoint(
    denv: DynamoEnv, path: str, bodies: list[dict[str, Any]], *, response_plane: str = "tcp"
) -> list[Any]:
    """Each body sent to the Dynamo endpoint ``path`` (``namespace.component.endpoint``) by a Dynamo client of its
    own (a process: the bindings want asyncio); every answer, in order."""
    env = denv.worker_env()
    env.pop("DYN_SYSTEM_PORT", None)
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-c", _CALL, path, response_plane, json.dumps(bodies)],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    answers: list[Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return answers


_TOKENIZER: list[Tokenizer] = []


async def last_prompt(address: str) -> str:
    """The last prompt the engine at ``address`` accepted, decoded with special tokens kept (what the frontend's
    chat template rendered, tokenized)."""
    if not _TOKENIZER:
        _TOKENIZER.append(Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json")))
    ids = (await mock_stats(address))["last_prompt_token_ids"]
    return str(_TOKENIZER[0].decode([int(i) for i in ids], skip_special_tokens=False))
