"""`hearth serve`: one engine behind the OpenAI-compatible API.

Two processes: this one (HTTP, chat templates, tokenization, detokenization, tool parsing, streaming) and
the engine core (scheduler, KV cache, model), which `AsyncEngine` starts and stops. If the engine core dies
the server answers 503 and exits 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import hearth
from hearth.engine.config import EngineConfig
from hearth.server.tool_parsers import available_tool_parsers

logger = logging.getLogger("hearth.server")

DEFAULT_MODEL_DIR = Path(hearth.__file__).resolve().parents[2] / "models" / "demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineConfig.add_cli_arguments(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    group.add_argument("--port", type=port_number, default=8000, help="port to bind (0: any free port)")
    group.add_argument(
        "--api-key",
        default=os.environ.get("HEARTH_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (default: $HEARTH_API_KEY)",
    )
    group.add_argument(
        "--max-queued-requests",
        dest="max_waiting_seqs",
        type=int,
        default=256,
        help="sequences that may wait beyond --max-num-seqs before new requests get 429",
    )
    group.add_argument(
        "--tool-call-parser",
        default="hermes",
        choices=[*available_tool_parsers(), "none"],
        help="format of the model's tool calls (none: return the text as is)",
    )
    group.add_argument(
        "--chat-template", default=None, help="a jinja file to use instead of the checkpoint's"
    )
    group.add_argument(
        "--shutdown-timeout",
        dest="shutdown_timeout_s",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM before they are aborted",
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body accepted; larger ones get 413 before they are read (default 16 MiB)",
    )
    group.add_argument(
        "--header-read-timeout",
        dest="header_read_timeout_s",
        type=float,
        default=10.0,
        help="seconds a client has to send a request's headers before the connection is closed",
    )
    group.add_argument(
        "--body-read-timeout",
        dest="body_read_timeout_s",
        type=float,
        default=60.0,
        help="seconds a client has to send a request's body before it gets 408",
    )
    group.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="let special-token text in chat messages (<|im_start|>) become control tokens; "
        "by default it is tokenized as text",
    )
    group.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_pd_arguments(parser)


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    from hearth.engine.config import ROLE_CHOICES

    group = parser.add_argument_group("prefill/decode disaggregation (docs/pd-protocol.md)")
    group.add_argument(
        "--role",
        default="mixed",
        choices=ROLE_CHOICES,
        help="mixed: computes everything; prefill: computes prompts and sends their KV; decode: receives "
        "prompt KV and answers",
    )
    group.add_argument(
        "--kv-transfer", default="tcp", choices=("tcp", "mooncake"), help="how KV moves between servers"
    )
    group.add_argument(
        "--kv-transfer-host", default="127.0.0.1", help="decode role: address the KV listener binds"
    )
    group.add_argument(
        "--kv-transfer-port", type=int, default=0, help="decode role: KV listener port (0: any free port)"
    )
    group.add_argument(
        "--kv-transfer-secret",
        default=None,
        help="the deployment's shared KV transfer secret (default: $HEARTH_KV_TRANSFER_SECRET)",
    )
    group.add_argument(
        "--kv-transfer-timeout",
        dest="kv_transfer_timeout_s",
        type=float,
        default=30.0,
        help="seconds a decode request waits for its KV before it computes the prompt itself",
    )


def port_number(text: str) -> int:
    """A TCP port for argparse: 0 (any free port) to 65535. `--port 70000` used to listen on 70000 % 65536."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535; 0 picks a free port)")
    return port


def resolve_model_dir(model: str | None) -> Path:
    """The checkpoint to serve: `--model` (a directory, a GGUF file, or a short name such as `smollm2`,
    `hearth.model.named_models`), else the bundled demo model. Exits with a message if neither exists."""
    if model is not None:
        from hearth.model.config import ModelLoadError
        from hearth.model.gguf_file import is_gguf_path
        from hearth.model.named_models import resolve_named_model

        try:
            path = resolve_named_model(model) or Path(model)
        except ModelLoadError as exc:
            raise SystemExit(f"hearth serve: {exc}") from None
        if not (path.is_dir() or is_gguf_path(path)):
            raise SystemExit(f"hearth serve: --model {model}: no such directory or GGUF file")
        return path
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise SystemExit(
            f"hearth serve: no default model exists yet ({DEFAULT_MODEL_DIR} is missing); "
            "pass --model DIR with a Hugging Face checkpoint directory"
        )
    return DEFAULT_MODEL_DIR


def _note_signal(signum: int, frame: FrameType | None) -> None:
    logger.info("stopped by %s", signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from hearth.engine.async_engine import AsyncEngine
    from hearth.server.app import build_app
    from hearth.server.limits import header_timeout_protocol
    from hearth.server.shutdown import FLUSH_TIMEOUT_S, DrainingServer, bind_socket
    from hearth.server.state import ServerConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        model_dir = resolve_model_dir(args.model)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.max_waiting_seqs < 0:
        print("hearth serve: --max-queued-requests must be >= 0", file=sys.stderr)
        return 2
    if args.max_request_bytes < 1 or args.header_read_timeout_s <= 0 or args.body_read_timeout_s <= 0:
        print(
            "hearth serve: --max-request-bytes, --header-read-timeout and --body-read-timeout must be > 0",
            file=sys.stderr,
        )
        return 2
    try:
        engine_config = EngineConfig.from_cli_args(args, model=str(model_dir), load_progress=True)
    except ValueError as exc:
        print(f"hearth serve: {exc}", file=sys.stderr)
        return 2
    if args.kv_transfer_secret:
        # The engine core reads it from its environment: it never appears in its command line.
        os.environ["HEARTH_KV_TRANSFER_SECRET"] = args.kv_transfer_secret
    if engine_config.role != "mixed" and not os.environ.get("HEARTH_KV_TRANSFER_SECRET"):
        print(
            f"hearth serve: --role {engine_config.role} needs the deployment's KV transfer secret: pass "
            "--kv-transfer-secret or set $HEARTH_KV_TRANSFER_SECRET (the same on every server)",
            file=sys.stderr,
        )
        return 2
    if engine_config.node_rank > 0:  # this host only runs ranks; node 0 serves the API
        from hearth.distributed.node import run_node

        return run_node(engine_config)
    server_config = ServerConfig(
        model_name=engine_config.model_name,
        api_key=args.api_key or None,
        max_waiting_seqs=args.max_waiting_seqs,
        tool_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        chat_template_path=args.chat_template,
        aliases=(
            str(model_dir),
            str(model_dir.resolve()),
            model_dir.name,
            *([args.model] if args.model else []),
        ),
        role=engine_config.role,
        kv_transfer=engine_config.kv_transfer,
        max_request_bytes=args.max_request_bytes,
        body_read_timeout_s=args.body_read_timeout_s,
        allow_special_tokens_in_content=args.allow_special_tokens_in_content,
    )
    try:
        # Bound before the model loads: a port in use is reported now, not after a minute of loading.
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        print(
            f"hearth serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr
        )
        return 1
    # The model runs in the engine-core process; torch threads here would only compete with it for cores.
    torch.set_num_threads(1)
    failures: list[BaseException] = []
    engine_deaths: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_failure(exc: BaseException) -> None:
        failures.append(exc)
        if server is not None:
            server.should_exit = True

    def on_engine_death(reason: str) -> None:
        # In-flight and new requests already get 503s; stop taking connections and exit non-zero.
        engine_deaths.append(reason)
        if server is not None:
            server.should_exit = True

    app = build_app(
        server_config,
        lambda: AsyncEngine(engine_config, on_dead=on_engine_death),
        str(model_dir),
        engine_config.max_num_seqs,
        on_load_failure,
    )
    uvicorn_config = uvicorn.Config(
        app,
        host=args.host,
        port=sock.getsockname()[1],
        log_level=args.log_level,
        access_log=args.access_log,
        # DrainingServer waits --shutdown-timeout and ends what is left with errors; this is only the time
        # those error answers get to go out.
        timeout_graceful_shutdown=FLUSH_TIMEOUT_S,
        timeout_keep_alive=30,
        http=header_timeout_protocol(args.header_read_timeout_s),
    )
    server = DrainingServer(uvicorn_config, app.state.hearth, args.shutdown_timeout_s)
    logger.info("loading %s (the API answers 503 until it is ready)", model_dir)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler that was
    # installed before it; with this one the process then exits 0 rather than dying by the signal.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _note_signal)
    server.run(sockets=[sock])
    if app.state.hearth.engine is None and not failures and not engine_deaths:
        print("hearth serve: stopped before the model finished loading", file=sys.stderr)
        return 0
    if failures:
        print(f"hearth serve: could not load {model_dir}: {failures[0]}", file=sys.stderr)
        return 1
    if engine_deaths:
        print(f"hearth serve: {engine_deaths[0]}; stopped serving", file=sys.stderr)
        return 1
    return 0
