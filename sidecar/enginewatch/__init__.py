"""The engine watch: how the worker follows its engine once it serves, and how it comes back after losing it.

One :class:`EngineWatch` per worker, made once the engine client is open. It asks the engine who it is and whether it
is ready (start-up and every rediscovery: :meth:`EngineWatch.discover_until_ready`), then, while the worker serves,
runs three watches (:meth:`EngineWatch.run`):

* the **health watch** polls ``Control.Health``: not READY degrades the worker (out of routing, in-flight requests go
  on), an engine that is gone sends it through the way back (reconnect, rediscover, register), a GOAWAY withdraws it
  until the engine's connections have drained;
* the **identity watch** runs the same way back when another engine answers on the address (a new instance id from
  the load poller, or a request that lost its connection and an engine that answers as someone else);
* the **stall watch**: when a request's inactivity timeout finds the engine producing nothing at all, the worker is
  withdrawn, and a one-token canary generation brings it back.

Everything that changes the worker's lifecycle is a transition of its machine (``statemachines/worker.py``); what the
watch needs of the worker around it -- routing in and out, the model card, the serving context, the LoRA resync -- it
asks through :class:`WatchHost`, so that the watch can be driven in virtual time against in-memory fakes.
"""

from ._probe import PortProbe
from ._watch import PROBE_INTERVAL_S, EngineWatch, Probe, WatchHost

__all__ = ["PROBE_INTERVAL_S", "EngineWatch", "PortProbe", "Probe", "WatchHost"]
