"""What every handler needs: the engine, the server's options, and the per-server bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hearth.server.admission import AdmissionController
from hearth.server.chat_template import ChatTemplate
from hearth.server.errors import APIError
from hearth.server.load import LoadTracker
from hearth.server.metrics import ServerMetrics
from hearth.server.reasoning_parsers import ReasoningParser
from hearth.server.response_store import ResponseStore
from hearth.server.tool_parsers import ToolParser

if TYPE_CHECKING:
    from hearth.engine.async_engine import AsyncEngine
    from hearth.server.generation import Generation
    from hearth.server.tokenization import PromptTokenizer


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_waiting_seqs: int = 256
    tool_parser: str | None = "hermes"
    reasoning_parser: str | None = None
    chat_template_path: str | None = None
    aliases: tuple[str, ...] = ()  # other names accepted as `model` (e.g. the checkpoint path)
    role: str = "mixed"  # prefill/decode disaggregation role (docs/pd-protocol.md)
    kv_transfer: str = "tcp"  # the KV transport between prefill and decode servers
    max_request_bytes: int = 16 * 1024 * 1024  # larger bodies get 413 before they are read
    body_read_timeout_s: float = 60.0  # a body not fully received by then gets 408
    allow_special_tokens_in_content: bool = False  # `<|im_start|>` in a message is text unless set
    log_requests: bool = False  # --enable-log-requests: one log line per request
    tokenizer_dir: str | None = None  # --tokenizer: where the chat template comes from (default: the model)
    max_stored_responses: int = 4096  # `store: true` Responses kept for previous_response_id (per server)
    stored_response_ttl_s: float = 3600.0


@dataclass
class ServerState:
    config: ServerConfig
    metrics: ServerMetrics
    admission: AdmissionController
    load: LoadTracker = field(default_factory=LoadTracker)
    engine: AsyncEngine | None = None
    chat_template: ChatTemplate | None = None
    chat_template_error: str | None = None
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    created_s: int = field(default_factory=lambda: int(time.time()))
    load_error: str | None = None
    prompts: PromptTokenizer | None = None  # set with the engine
    # Requests whose engine streams are open, so a shutdown past its timeout can end each one cleanly.
    live: set[Generation] = field(default_factory=set)
    _token_text_cache: dict[int, str] = field(default_factory=dict)
    kv_peers: Any = None  # hearth.server.pd.KVPeers on a prefill server
    responses: ResponseStore = field(default_factory=ResponseStore)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.dead is None

    @property
    def engine_error(self) -> str | None:
        """Why the server cannot serve any more (the model did not load, the engine died), or None."""
        if self.load_error is not None:
            return self.load_error
        return self.engine.dead if self.engine is not None else None

    def require_engine(self) -> AsyncEngine:
        if self.engine is None:
            raise APIError(
                "the model is still loading; retry shortly",
                503,
                "service_unavailable",
                code="model_loading",
                headers={"Retry-After": "5"},
            )
        if self.engine.dead is not None:
            raise APIError(
                f"{self.engine.dead}; this server is shutting down",
                503,
                "service_unavailable",
                code="engine_dead",
            )
        return self.engine

    def require_prompts(self) -> PromptTokenizer:
        self.require_engine()
        assert self.prompts is not None  # set together with the engine
        return self.prompts

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.config.model_name or model in self.config.aliases:
            return
        raise APIError(
            f"The model {model!r} does not exist; this server serves {self.config.model_name!r}",
            404,
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )

    def token_text(self, token_id: int) -> str:
        # Logprobs name each token by its own text; decoding one id at a time is cached per id.
        text = self._token_text_cache.get(token_id)
        if text is None:
            engine = self.require_engine()
            text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def stats(self) -> Any | None:
        return self.engine.stats() if self.engine is not None else None
