"""Lifecycle state machines: the tables are the single source of truth.

One module per machine (``worker``, ``request``, ``kv_subscription``, ``lora``), each a set of tables (``STATES``,
``TRANSITIONS``, ``TERMINAL``, ``NO_OPS``, ``STATE_DOCS``) built into one shared ``transitions.Machine`` per kind (see
``_base`` for the theory of operation).  Sans-IO: imports only ``transitions`` and the standard library.

    req = RequestLifecycle("req-1")
    req.fire("submit")
    REQUEST.observers.append(lambda model, event, source, dest: ...)
    REQUEST.counts()   # {"received": 0, "submitted": 1, ...}
"""

from typing import Any

from ._base import IllegalTransition as IllegalTransition
from ._base import Lifecycle as Lifecycle
from ._base import MachineKind as MachineKind
from ._base import StateDoc as StateDoc
from ._base import StateMachineError as StateMachineError
from .kv_subscription import KV_SUBSCRIPTION as KV_SUBSCRIPTION
from .kv_subscription import KvSubscriptionEvent as KvSubscriptionEvent
from .kv_subscription import KvSubscriptionLifecycle as KvSubscriptionLifecycle
from .kv_subscription import KvSubscriptionObserver as KvSubscriptionObserver
from .kv_subscription import KvSubscriptionState as KvSubscriptionState
from .lora import LORA as LORA
from .lora import LoraEvent as LoraEvent
from .lora import LoraLifecycle as LoraLifecycle
from .lora import LoraObserver as LoraObserver
from .lora import LoraState as LoraState
from .request import REQUEST as REQUEST
from .request import RequestEvent as RequestEvent
from .request import RequestLifecycle as RequestLifecycle
from .request import RequestObserver as RequestObserver
from .request import RequestState as RequestState
from .worker import WORKER as WORKER
from .worker import WorkerEvent as WorkerEvent
from .worker import WorkerLifecycle as WorkerLifecycle
from .worker import WorkerObserver as WorkerObserver
from .worker import WorkerState as WorkerState

KINDS: tuple[MachineKind[Any, Any, Any], ...] = (WORKER, REQUEST, KV_SUBSCRIPTION, LORA)
"""Every machine kind, for the live state view and the docs generator."""

__all__ = [
    "KINDS",
    "KV_SUBSCRIPTION",
    "LORA",
    "REQUEST",
    "WORKER",
    "IllegalTransition",
    "KvSubscriptionEvent",
    "KvSubscriptionLifecycle",
    "KvSubscriptionObserver",
    "KvSubscriptionState",
    "Lifecycle",
    "LoraEvent",
    "LoraLifecycle",
    "LoraObserver",
    "LoraState",
    "MachineKind",
    "RequestEvent",
    "RequestLifecycle",
    "RequestObserver",
    "RequestState",
    "StateDoc",
    "StateMachineError",
    "WorkerEvent",
    "WorkerLifecycle",
    "WorkerObserver",
    "WorkerState",
]
