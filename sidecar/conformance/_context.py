"""What the checks share during one run: configuration, channels, discovery, request builders, cached samples."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from openengine.v1 import generation_pb2, model_pb2, openengine_grpc, server_pb2

from ._model import SkipCheck
from ._wire import Call, Observation, RawMessage, Target, call, generate
from .rules import terminal_index

if TYPE_CHECKING:
    from google.protobuf.message import Message

__all__ = ["PROMPT", "Context", "Hold", "KitConfig"]

_R = TypeVar("_R")

#: The text of every ordinary request: short, plain ASCII, any tokenizer splits it into several tokens.
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
#: Token ids used only when the engine takes no text (``supports_text_input = false``): small ids exist in any vocab.
FALLBACK_TOKEN_IDS = (1, 2, 3, 4, 5, 6, 7, 8)
#: Tokens of a long ("held") request: long enough to stay open while a check acts on it, bounded for slow engines.
HOLD_TOKENS_MAX = 2048


@dataclass(frozen=True, slots=True)
class KitConfig:
    """One run's settings (from the command line, see ``_cli.py``)."""

    target: Target
    decode_target: Target | None = None
    model: str | None = None
    rpc_timeout: float = 10.0
    settle: float = 10.0
    check_timeout: float = 60.0
    include_stop: bool = False
    stop_command: tuple[str, ...] | None = None
    stop_wait: float = 60.0
    lora_dir: str | None = None
    only: tuple[str, ...] = ()


@dataclass(slots=True)
class Hold:
    """A long generation kept open while a check acts on it; ``obs`` fills as messages arrive."""

    obs: Observation
    task: asyncio.Task[Observation]

    @property
    def streaming(self) -> bool:
        """The request was accepted and is still running."""
        return self.obs.accepted and not self.obs.done.is_set()

    async def wait_done(self, bound: float) -> bool:
        with suppress(TimeoutError):
            await asyncio.wait_for(self.obs.done.wait(), bound)
        return self.obs.done.is_set()


class Context:
    """Shared state of one run. Created by the runner, which also closes it."""

    def __init__(self, config: KitConfig) -> None:
        self.config = config
        self.control_channel = config.target.channel()
        self.inference_channel = config.target.channel()
        self.control = openengine_grpc.ControlStub(self.control_channel)
        self.server_info: Call[server_pb2.ServerInfo] = Call(None, None, error="not asked yet")
        self.model_info: Call[model_pb2.ModelInfo] = Call(None, None, error="not asked yet")
        self.model = config.model or ""
        self._nonce = secrets.token_hex(4)
        self._ids = 0
        self._samples: dict[str, Observation] = {}
        self._sample_lock = asyncio.Lock()
        self._baseline: Observation | None = None
        #: What one check leaves for a later one (e.g. the prefill leg's KvSessionRef for the decode leg).
        self.memo: dict[str, object] = {}

    async def aclose(self) -> None:
        for channel in (self.control_channel, self.inference_channel):
            channel.close()

    # -- discovery -----------------------------------------------------------------------------------------------------

    async def discover(self) -> None:
        """``GetServerInfo`` then ``GetModelInfo`` (for ``--model`` or the first supported model)."""
        self.server_info = await self.unary(self.control.GetServerInfo, server_pb2.GetServerInfoRequest())
        if self.server_info.ok and not self.model:
            models = self.server_info.get().supported_models
            self.model = models[0] if models else ""
        self.model_info = await self.unary(self.control.GetModelInfo, model_pb2.GetModelInfoRequest(model=self.model))
        if self.model_info.ok and not self.model:
            self.model = self.model_info.get().served_model_name

    @property
    def info(self) -> server_pb2.ServerInfo:
        if not self.server_info.ok:
            raise SkipCheck(f"needs ServerInfo (GetServerInfo: {self.server_info.describe()})")
        return self.server_info.get()

    @property
    def minfo(self) -> model_pb2.ModelInfo:
        if not self.model_info.ok:
            raise SkipCheck(f"needs ModelInfo (GetModelInfo: {self.model_info.describe()})")
        return self.model_info.get()

    @property
    def role(self) -> int:
        """The engine role; values this kit does not know read as UNSPECIFIED (wire §7.1)."""
        role = self.info.engine_role
        return role if role in server_pb2.EngineRole.values() else server_pb2.ENGINE_ROLE_UNSPECIFIED

    @property
    def role_name(self) -> str:
        return str(server_pb2.EngineRole.Name(self.role)).removeprefix("ENGINE_ROLE_")

    @property
    def serves_generation(self) -> bool:
        """The engine serves plain (aggregated) requests: roles UNSPECIFIED and AGGREGATED do."""
        return self.role in (server_pb2.ENGINE_ROLE_UNSPECIFIED, server_pb2.ENGINE_ROLE_AGGREGATED)

    def require_generation(self) -> None:
        """Skip unless the engine serves plain (aggregated) requests."""
        if not self.serves_generation:
            raise SkipCheck(f"engine role {self.role_name} serves no aggregated requests")

    def require_requests(self) -> None:
        """Skip unless the engine takes requests without a KV session: every role but DECODE.

        A PREFILL engine is sent its requests as context-only legs (see :meth:`request`), so the validation rules
        can be judged on it too.
        """
        if self.role == server_pb2.ENGINE_ROLE_DECODE:
            raise SkipCheck("engine role DECODE takes only requests with a KV session")

    @property
    def window(self) -> int | None:
        info = self.model_info.response
        return info.max_context_length if info is not None and info.HasField("max_context_length") else None

    def advertised(self, name: str) -> bool | None:
        """A ``ModelInfo`` boolean (``supports_*``) or generation capability: ``None`` when not reported."""
        info = self.model_info.response
        if info is None:
            return None
        field: Any = name
        with suppress(ValueError):
            if info.HasField(field):
                return bool(getattr(info, name))
        with suppress(ValueError):
            if info.HasField("generation") and info.generation.HasField(field):
                return bool(getattr(info.generation, name))
        return None

    # -- calls ---------------------------------------------------------------------------------------------------------

    async def unary(
        self, method: Callable[..., Awaitable[_R]], request: Message, bound: float | None = None
    ) -> Call[_R]:
        return await call(method, request, bound=bound or self.config.rpc_timeout)

    @property
    def nonce(self) -> str:
        """This run's random tag (in every request id, adapter name and unique prompt)."""
        return self._nonce

    def new_id(self, tag: str) -> str:
        self._ids += 1
        return f"oe-conformance-{self._nonce}-{self._ids}-{tag}"

    def request(
        self,
        tag: str,
        *,
        max_tokens: int | None = 8,
        temperature: float | None = 0.0,
        ignore_eos: bool | None = True,
        n: int | None = None,
        seed: int | None = None,
        request_id: str | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> generation_pb2.GenerateRequest:
        """An ordinary request: the model, a short prompt, greedy, ``max_tokens`` always set (trtllm §12 item 4)."""
        req = generation_pb2.GenerateRequest(
            request_id=request_id if request_id is not None else self.new_id(tag), model=self.model
        )
        if token_ids is not None:
            req.token_ids.ids.extend(token_ids)
        elif self.advertised("supports_text_input") is False:
            req.token_ids.ids.extend(FALLBACK_TOKEN_IDS)
        else:
            req.prompt = PROMPT
        if max_tokens is not None:
            req.stopping.max_tokens = max_tokens
        if ignore_eos is not None:
            req.stopping.ignore_eos = ignore_eos
        if temperature is not None:
            req.sampling.temperature = temperature
        if n is not None:
            req.sampling.num_sequences = n
        if seed is not None:
            req.sampling.seed = seed
        if self.server_info.ok and self.role == server_pb2.ENGINE_ROLE_PREFILL:
            # The phase hint TensorRT-LLM reads (trtllm §8); a PREFILL engine refuses requests without it.
            req.extra.update({"request_type": "context_only"})
        return req

    async def observe(
        self,
        request: generation_pb2.GenerateRequest | RawMessage,
        *,
        bound: float | None = None,
        metadata: Mapping[str, str] | None = None,
        request_id: str | None = None,
    ) -> Observation:
        return await generate(
            self.inference_channel,
            request,
            bound=bound or self.config.rpc_timeout,
            metadata=metadata,
            request_id=request_id,
        )

    # -- shared samples ------------------------------------------------------------------------------------------------

    async def baseline(self) -> Observation:
        """The plain request every stream check builds on: greedy, ``ignore_eos``, ``max_tokens = 8``, n = 1."""
        async with self._sample_lock:
            if self._baseline is None:
                self.require_generation()
                self._baseline = await self.observe(self.request("baseline"))
        return self._baseline

    async def good_baseline(self) -> Observation:
        """The baseline, or a skip naming why it cannot be built on (judged by ``stream.plain_request``)."""
        obs = await self.baseline()
        if not obs.accepted or terminal_index(obs) is None:
            raise SkipCheck(f"the plain request did not complete ({obs.describe_end()}; see stream.plain_request)")
        return obs

    async def sample(self, name: str, request: generation_pb2.GenerateRequest) -> Observation:
        """Run ``request`` once per run under ``name``; later callers get the same observation."""
        async with self._sample_lock:
            if name not in self._samples:
                self._samples[name] = await self.observe(request)
            return self._samples[name]

    @property
    def prompt_tokens(self) -> int | None:
        """The ordinary prompt's length in tokens, from the baseline's usage."""
        obs = self._baseline
        if obs is None or not obs.messages or not obs.messages[-1].HasField("usage"):
            return None
        return obs.messages[-1].usage.prompt_tokens

    @property
    def hold_tokens(self) -> int:
        """``max_tokens`` of a held request: as long as the window allows (a fast engine must not finish first)."""
        limit = HOLD_TOKENS_MAX
        window, prompt = self.window, self.prompt_tokens
        if window is not None:
            limit = min(limit, window - (prompt if prompt is not None else 64) - 8)
        info = self.model_info.response
        if info is not None and info.HasField("max_output_tokens"):
            limit = min(limit, info.max_output_tokens)
        return max(limit, 1)

    @asynccontextmanager
    async def hold(self, tag: str, *, request_id: str | None = None) -> AsyncIterator[Hold]:
        """A long greedy request, open until the block ends (then its RPC is cancelled and its end awaited).

        Entered once the first message arrived, the stream ended, or ``settle`` seconds passed.
        """
        self.require_generation()
        request = self.request(tag, max_tokens=self.hold_tokens, request_id=request_id)
        obs = Observation(request_id=request.request_id, n=1, request=request)
        bound = self.config.settle * 3 + self.config.rpc_timeout
        task = asyncio.create_task(
            generate(self.inference_channel, request, bound=bound, observation=obs), name=f"hold {tag}"
        )
        hold = Hold(obs, task)
        try:
            first = asyncio.ensure_future(obs.first_message.wait())
            done = asyncio.ensure_future(obs.done.wait())
            try:
                await asyncio.wait({first, done}, timeout=self.config.settle, return_when=asyncio.FIRST_COMPLETED)
            finally:
                first.cancel()
                done.cancel()
            yield hold
        finally:
            if not task.done():
                task.cancel()
            with suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), self.config.settle)

    async def running_requests(self) -> int | None:
        """``GetLoad.running_requests`` now, ``None`` when the engine does not report it (or GetLoad fails)."""
        load = await self.unary(self.control.GetLoad, server_pb2.GetLoadRequest())
        if not load.ok or not load.get().HasField("running_requests"):
            return None
        return int(load.get().running_requests)

    async def wait_idle(self) -> tuple[int | None, float]:
        """Poll ``GetLoad`` until ``running_requests`` is 0 or ``settle`` passes: (last value, seconds waited)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            running = await self.running_requests()
            waited = loop.time() - started
            if running is None or running == 0 or waited > self.config.settle:
                return running, waited
            await asyncio.sleep(0.05)
