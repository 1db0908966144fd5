"""`hearth serve`: one engine behind the OpenAI-compatible API.

Two processes: this one (HTTP, chat templates, tokenization, detokenization, tool parsing, streaming) and
the engine core (scheduler, KV cache, model), which `AsyncEngine` starts and stops. If the engine core dies
the server answers 503 and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import hearth
from hearth.contracts.cli_common import (
    API_KEY_ENV,
    KV_TRANSFER_SECRET_ENV,
    KV_TRANSFER_SECRET_FILE_ENV,
    add_kv_transfer_secret_arguments,
    add_listen_arguments,
    add_log_level_argument,
)
from hearth.engine.config import EngineConfig
from hearth.server.reasoning_parsers import available_reasoning_parsers
from hearth.server.tool_parsers import available_tool_parsers

logger = logging.getLogger("hearth.server")

DEFAULT_MODEL_DIR = Path(hearth.__file__).resolve().parents[2] / "models" / "demo"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory or Hugging Face repo id (as --model; vLLM's `vllm serve MODEL`)",
    )
    EngineConfig.add_cli_arguments(parser)
    add_vllm_arguments(parser)
    group = parser.add_argument_group("server")
    add_listen_arguments(group)
    group.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize (default: ${API_KEY_ENV})",
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
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice 'auto' is always on when a tool-call parser is set",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=available_reasoning_parsers(),
        help="split the model's thinking into reasoning_content (default: none, thinking stays in content)",
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
    add_log_level_argument(group, default="info")
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the HTTP server's log level (default: --log-level)",
    )
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    group.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=False,
        help="log every request's id, prompt length and sampling parameters",
    )
    group.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="do not log requests (the default)",
    )
    add_pd_arguments(parser)


def add_pd_arguments(parser: argparse.ArgumentParser) -> None:
    """The deployment secret a prefill or decode server needs (`--role` and the KV transfer options are
    engine options, generated with the others)."""
    group = parser.add_argument_group("prefill/decode secret (docs/pd-protocol.md)")
    add_kv_transfer_secret_arguments(group, "authenticates KV transfers and PD instructions", with_value=True)


def add_vllm_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM options that name the model or say what the server may do: kept where their meaning holds,
    refused by `check_vllm_arguments` (with the Hearth way) where it cannot."""
    group = parser.add_argument_group("coming from vLLM (docs/server.md)")
    group.add_argument(
        "--config",
        default=None,
        help="a YAML file of options (`port: 8000`, `max-model-len: 32k`); the command line wins",
    )
    group.add_argument(
        "--revision", default=None, help="a Hub repo id's branch, tag or commit in the local HF cache"
    )
    group.add_argument(
        "--download-dir",
        default=None,
        help="the Hugging Face cache to find repo ids in (default: $HF_HUB_CACHE)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted; Hearth runs only its own architectures' code, never a checkpoint's",
    )
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Hearth always chunks long prompts (to --max-num-batched-tokens); --no-enable-chunked-prefill is refused",
    )
    group.add_argument(
        "--disable-log-stats", action="store_true", help="accepted; Hearth logs no periodic stats"
    )
    group.add_argument("--enable-lora", action="store_true", help="refused: Hearth serves no LoRA adapters")
    group.add_argument(
        "--lora-modules", nargs="+", default=None, help="refused: Hearth serves no LoRA adapters"
    )
    group.add_argument("--max-loras", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument("--max-lora-rank", type=int, default=None, help=argparse.SUPPRESS)
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="only 1: run several servers behind `hearth route` (or `hearth launch`) instead",
    )
    group.add_argument(
        "--kv-transfer-config", default=None, help="refused: use --role prefill|decode and `hearth route`"
    )
    group.add_argument(
        "--load-format", default="auto", help="auto or safetensors (GGUF files load from --model FILE.gguf)"
    )


def check_vllm_arguments(args: argparse.Namespace) -> str | None:
    """What a vLLM option asks that Hearth cannot do, said with the Hearth way; None when all hold."""
    if args.enable_lora or args.lora_modules or args.max_loras or args.max_lora_rank:
        return (
            "LoRA adapters (--enable-lora, --lora-modules) are not supported; merge the adapter into the base "
            "weights (peft's merge_and_unload) and serve the merged checkpoint with --model DIR"
        )
    if not args.enable_chunked_prefill:
        return (
            "--no-enable-chunked-prefill is not supported: Hearth always splits long prompts into steps of "
            "--max-num-batched-tokens; raise that instead to prefill a prompt in one step"
        )
    if args.data_parallel_size != 1:
        return (
            "--data-parallel-size is not supported inside one server; run one `hearth serve` per replica "
            "behind `hearth route` (or `hearth launch --mixed N`)"
        )
    if args.kv_transfer_config:
        return (
            "--kv-transfer-config is not supported; disaggregate with --role prefill|decode "
            "(docs/pd-protocol.md) behind `hearth route`"
        )
    if args.load_format not in ("auto", "safetensors", "gguf"):
        return f"--load-format {args.load_format} is not supported; Hearth reads safetensors and GGUF files"
    return None


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--config FILE` (YAML: option names with dashes or underscores -> values) as command-line words
    placed before the real ones, so the command line wins. vLLM's file format."""
    path = None
    rest: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--config":
            path = next(words, None)
            if path is None:
                parser.error("--config needs a file")
        elif word.startswith("--config="):
            path = word.split("=", 1)[1]
        else:
            rest.append(word)
    if path is None:
        return argv
    import yaml

    try:
        with open(path) as handle:
            options = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(options, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    known = {option: action for action in parser._actions for option in action.option_strings}
    expanded: list[str] = []
    for key, value in options.items():
        option = "--" + str(key).replace("_", "-")
        if str(key) in ("model", "model_tag") and "--model" in known:
            option = "--model"
        action = known.get(option)
        if action is None:
            parser.error(f"--config {path}: unknown option {key!r}")
        if isinstance(value, bool) and action.metavar == "{on,off}":
            expanded += [option, "on" if value else "off"]  # YAML reads a bare `on` as true
        elif isinstance(value, bool):
            if value and action.nargs == 0:
                expanded.append(option)
            elif not value and action.nargs == 0:
                negative = "--no-" + option[2:]
                if negative in known:
                    expanded.append(negative)
            else:
                expanded += [option, str(value).lower()]
        elif isinstance(value, list):
            expanded += [option, *[str(item) for item in value]]
        elif isinstance(value, dict):
            import json

            expanded += [option, json.dumps(value)]
        elif value is not None:
            expanded += [option, str(value)]
    return expanded + rest


def resolve_model_dir(model: str | None, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """The checkpoint to serve: `--model` (a directory, a GGUF file, a short name such as `smollm2`
    (`hearth.model.named_models`), or a Hub repo id in the local HF cache), else the bundled demo model.
    Exits with a message if none exists."""
    if model is not None:
        from hearth.model.config import ModelLoadError
        from hearth.model.gguf_file import is_gguf_path
        from hearth.model.named_models import resolve_named_model

        try:
            path = resolve_named_model(model) or Path(model)
        except ModelLoadError as exc:
            raise SystemExit(f"hearth serve: {exc}") from None
        if path.is_dir() or is_gguf_path(path):
            return path
        from hearth.model.hub_cache import ModelNotCachedError, looks_like_repo_id, resolve_cached_repo

        if not looks_like_repo_id(model) or path.exists():
            raise SystemExit(f"hearth serve: --model {model}: no such directory or GGUF file")
        try:
            return resolve_cached_repo(model, revision, cache_dir)
        except ModelNotCachedError as exc:
            raise SystemExit(f"hearth serve: --model {exc}") from None
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
    refused = check_vllm_arguments(args)
    if refused is not None:
        print(f"hearth serve: {refused}", file=sys.stderr)
        return 2
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        print(
            f"hearth serve: two models given ({args.model_tag} and --model {args.model}); give one",
            file=sys.stderr,
        )
        return 2
    model_arg = args.model_tag or args.model
    try:
        model_dir = resolve_model_dir(model_arg, args.revision, args.download_dir)
        if args.tokenizer is not None:
            args.tokenizer = str(resolve_model_dir(args.tokenizer, None, args.download_dir))
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.trust_remote_code:
        logger.info("--trust-remote-code: Hearth runs no code from checkpoints; its own architectures load")
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
        os.environ[KV_TRANSFER_SECRET_ENV] = args.kv_transfer_secret
    if getattr(args, "kv_transfer_secret_file", None):
        os.environ[KV_TRANSFER_SECRET_FILE_ENV] = args.kv_transfer_secret_file
    if engine_config.role != "mixed":
        from hearth.kv_transfer.auth import MissingSecretError, deployment_secret

        try:
            deployment_secret()
        except MissingSecretError as exc:
            print(f"hearth serve: --role {engine_config.role}: {exc}", file=sys.stderr)
            return 2
    if engine_config.node_rank > 0:  # this host only runs ranks; node 0 serves the API
        from hearth.engine.ranks.node import run_node

        return run_node(engine_config)
    names = args.served_model_name or []
    aliases = [str(model_dir), str(model_dir.resolve()), model_dir.name, *names[1:]]
    if model_arg is not None:
        aliases.append(model_arg)  # the repo id the client knows it by
    served_name = engine_config.served_model_name or (
        model_arg if model_arg and not Path(model_arg).exists() else None
    )
    if served_name is not None and served_name != engine_config.served_model_name:
        engine_config = dataclasses.replace(engine_config, served_model_name=served_name)
    server_config = ServerConfig(
        model_name=engine_config.model_name,
        api_key=args.api_key or None,
        max_waiting_seqs=args.max_waiting_seqs,
        tool_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        chat_template_path=args.chat_template,
        aliases=tuple(aliases),
        log_requests=args.log_requests,
        tokenizer_dir=args.tokenizer,
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
    bound_host, bound_port = sock.getsockname()[:2]
    # The real port (with --port 0 the kernel picks it): what clients and launchers read from the log.
    logger.info(
        "listening on http://%s:%d", f"[{bound_host}]" if ":" in bound_host else bound_host, bound_port
    )
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
        log_level=args.uvicorn_log_level or args.log_level,
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
