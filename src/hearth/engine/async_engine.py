"""`AsyncEngine`: the engine on its own thread, streaming each step's outputs to asyncio consumers.

The HTTP event loop never runs a forward pass: it hands requests to the engine thread through a
queue and receives outputs through `call_soon_threadsafe`, so serving stays responsive while the
engine steps, and each step's tokens go out as soon as the step ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from hearth.engine.config import EngineConfig
from hearth.engine.engine import EngineStats
from hearth.engine.factory import build_engine
from hearth.engine.messages import CoreOutput, EngineRequest
from hearth.engine.output_processor import OutputProcessor
from hearth.engine.outputs import RequestOutput
from hearth.engine.sampling_params import SamplingParams
from hearth.model.tokenizer import Tokenizer

logger = logging.getLogger("hearth.engine")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = build_engine(config)
        self.output_processor = OutputProcessor(self.engine.tokenizer)
        self.config = config
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hearth-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def num_kv_tokens(self) -> int:
        return self.engine.num_kv_tokens

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one output per step with new tokens; the last has `finish_reason`. Closing early aborts."""
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: asyncio.Future[None] = loop.create_future()
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, cache_salt, sink, loop, accepted))
        await accepted  # raises the engine's validation error, if any
        finished = False
        try:
            while True:
                item = await sink.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=30)

    # ---- the engine thread ----------------------------------------------------------------------

    def _deliver(self, output: RequestOutput) -> None:
        target = self._sinks.get(output.request_id)
        if target is None:
            return
        loop, sink = target
        if output.finished:
            del self._sinks[output.request_id]
        loop.call_soon_threadsafe(sink.put_nowait, output)

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        processed = self.output_processor.process(core_outputs)
        if processed.abort_request_ids:  # stop strings ended them; free their pages in the core
            self.engine.abort(processed.abort_request_ids, "finished by a stop string")
        return processed.request_outputs

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            for output in self._process(self.engine.abort([command.request_id], "aborted by the client")):
                self._deliver(output)
            return
        try:
            self.engine.add_request(
                EngineRequest(
                    command.request_id, command.prompt_token_ids, command.params, command.cache_salt
                )
            )
        except Exception as exc:  # validation errors go back to the caller
            command.loop.call_soon_threadsafe(_set_exception, command.accepted, exc)
            return
        self.output_processor.add_request(command.request_id, command.prompt_token_ids, command.params)
        self._sinks[command.request_id] = (command.loop, command.sink)
        command.loop.call_soon_threadsafe(_set_result, command.accepted)

    def _run(self) -> None:
        while not self._stopping:
            block = not self.engine.has_work
            try:
                command = self._commands.get(block=block, timeout=None if block else 0)
            except queue.Empty:
                command = None
                commands = []
            else:
                commands = [command]
            while True:  # drain everything that arrived during the last step
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for command in commands:
                if command is None:
                    if self._stopping:
                        break
                    continue
                self._apply(command)
            if self._stopping:
                break
            if not self.engine.has_work:
                continue
            try:
                outputs = self._process(self.engine.step())
            except Exception as exc:
                logger.exception("engine step failed; aborting the running requests")
                outputs = self._abort_all(f"engine error: {exc}")
            for output in outputs:
                self._deliver(output)
        for output in self._abort_all("server shutting down"):
            self._deliver(output)

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outputs = self._process(self.engine.abort(list(self._sinks), reason))
        for output in outputs:
            output.finish_reason = "error" if reason.startswith("engine error") else "abort"
        return outputs


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
