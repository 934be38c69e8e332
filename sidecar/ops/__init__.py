"""Operator surface: Prometheus metrics, structured logs, the live state feed and page, operator subcommands.

* :mod:`sidecar.ops.metrics` -- the ``openengine_sidecar_*`` metrics, exported on Dynamo's system port ``/metrics``;
* :mod:`sidecar.ops.logs` -- one line per event with request id and worker state (``--log-format text|json``);
* :mod:`sidecar.ops.feed`, :mod:`sidecar.ops.server`, :mod:`sidecar.ops.page` -- the live state feed (websocket) and
  page on the ops port (``--ops-host``/``--ops-port``);
* :mod:`sidecar.ops.cli` -- ``openengine-sidecar status|watch|probe``.

Submodules are imported explicitly (``from sidecar.ops import metrics``): the worker's hot path needs only
``metrics`` and ``logs``, not the web server or the terminal UI.
"""
