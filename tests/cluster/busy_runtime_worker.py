"""Serve control endpoints while Dynamo's runtime threads are busy in Python, as a serving worker's are.

Run as ``python tests/cluster/busy_runtime_worker.py --when {with-runtime,late}`` with ``DYN_SYSTEM_PORT``,
``ETCD_ENDPOINTS`` and ``NATS_SERVER`` set. It creates the runtime (etcd discovery, NATS planes), exports a
``/metrics`` callback that takes 20 ms (a Python callback preempted under load), keeps six scrapers on
``/metrics`` so the runtime's worker threads are in that callback or queued for the GIL, and then serves
``load_lora``/``unload_lora``/``list_loras``:

* ``with-runtime``: the sidecar's way, their endpoints built with the runtime (``open_dynamo(controls=...)``);
* ``late``: what the sidecar did before, ``runtime.endpoint(path)`` built once the runtime calls into Python.

Lines it prints (the test waits for them): ``BUSY <scrapes so far>``, ``SERVED <seconds>``, ``ANSWERED <body>``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import urllib.request
from typing import Any

import trio

from sidecar.dynamo import DynamoSettings, open_dynamo
from sidecar.dynamo import _bindings as b
from sidecar.edge import open_edge

CONTROLS = ("load_lora", "unload_lora", "list_loras")
SCRAPERS = 6
CALLBACK_S = 0.02


def say(*parts: object) -> None:
    sys.stdout.write(" ".join(map(str, parts)) + "\n")
    sys.stdout.flush()


class Scrapes:
    def __init__(self, url: str) -> None:
        self.url = url
        self.count = 0
        self.lock = threading.Lock()

    def exposition(self) -> str:
        time.sleep(CALLBACK_S)  # not a synchronisation: a metrics callback that is slow on purpose
        with self.lock:
            self.count += 1
        return "# busy\n"

    def scrape_forever(self) -> None:
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as answer:
                    answer.read()
            except OSError:
                time.sleep(0.01)  # not a synchronisation: the scraper's retry pace


async def main(when: str) -> None:
    settings = DynamoSettings(discovery_backend="etcd", request_plane="nats", event_plane="nats", namespace="busy")
    scrapes = Scrapes(f"http://127.0.0.1:{os.environ['DYN_SYSTEM_PORT']}")
    controls = CONTROLS if when == "with-runtime" else ()
    async with open_edge() as edge, open_dynamo(edge, settings, controls=controls) as dynamo:
        await dynamo.export_metrics(scrapes.exposition, list)
        for _ in range(SCRAPERS):
            threading.Thread(target=scrapes.scrape_forever, daemon=True).start()
        while scrapes.count < 2 * SCRAPERS:
            await trio.sleep(0.01)  # the poll interval of this standalone worker script (no tests.helpers here)
        say("BUSY", scrapes.count)

        async def answer(body: dict[str, Any]) -> dict[str, Any]:
            return {"status": "ok", "loras": [], "count": 0}

        async with trio.open_nursery() as nursery:
            t0 = time.monotonic()
            if when == "late":
                prefix = f"{settings.namespace}.{settings.component}"
                for name in CONTROLS:
                    await edge.run(_build, dynamo, f"{prefix}.{name}")
            else:
                await dynamo.serve_controls(nursery, dict.fromkeys(CONTROLS, answer))
            say("SERVED", f"{time.monotonic() - t0:.3f}")
            url = f"{scrapes.url}/engine/list_loras"
            request = urllib.request.Request(url, data=b"{}", headers={"content-type": "application/json"})
            body = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(request, timeout=10).read())
            say("ANSWERED", body.decode())
            nursery.cancel_scope.cancel(reason="done")
        # Scrapers keep the runtime busy to the end: leave without waiting for them.
        os._exit(0)


async def _build(dynamo: Any, path: str) -> None:
    runtime: b.DistributedRuntime = dynamo._runtime
    runtime.endpoint(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--when", choices=("with-runtime", "late"), required=True)
    trio.run(main, parser.parse_args().when)
