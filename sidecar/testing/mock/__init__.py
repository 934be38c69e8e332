"""``openengine-mock``: a simulated OpenEngine v0.1.0 engine in its own process (contract: ``docs/mock.md``).

Run it with ``openengine-mock`` or ``python -m sidecar.testing.mock``. The pieces:

* :mod:`.config` — flags → :class:`MockConfig`;
* :mod:`.validate` — request checks in TensorRT-LLM's order → :class:`RequestPlan` or a status;
* :mod:`.engine` — admission, KV blocks (:mod:`.kvcache`), model time, the response stream, Abort/GetLoad/Health;
* :mod:`.textstream` — incremental detokenization and stop-string hold-back;
* :mod:`.faults` — ``extra["mock"]`` fault injection;
* :mod:`.service` / :mod:`.server` — grpclib services and the process lifecycle;
* :mod:`.lm` — ``TinyLM``, the tiny text model (driven through :class:`~.lmapi.LanguageModel`).
"""

from .config import Capabilities as Capabilities
from .config import MockConfig as MockConfig
from .config import parse_args as parse_args
