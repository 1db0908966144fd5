"""What every Hearth command line shares, defined once: where to listen (`--host`, `--port`), how much to
log (`--log-level`), the KV page size, and the secrets (`--api-key`, `--admin-key[-file]`,
`--kv-transfer-secret[-file]`) with the environment variables they may come from instead.

`hearth serve`, `hearth route` and `hearth launch` add these flags from here, so a flag means the same in
each; `hearth launch` moves the secret-valued ones off its children's command lines (`SECRET_OPTIONS`).
"""

from __future__ import annotations

import argparse
from typing import Any

DEFAULT_HOST = "127.0.0.1"  # loopback only: exposing a server is a decision, not a default
DEFAULT_PORT = 8000
# Tokens per KV page. The router's prefix index must use the servers' page size to predict their cache hits.
DEFAULT_PAGE_SIZE = 16
LOG_LEVELS = ("debug", "info", "warning", "error")

API_KEY_ENV = "HEARTH_API_KEY"
ADMIN_KEY_ENV = "HEARTH_ROUTER_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "HEARTH_ROUTER_ADMIN_KEY_FILE"
KV_TRANSFER_SECRET_ENV = "HEARTH_KV_TRANSFER_SECRET"
KV_TRANSFER_SECRET_FILE_ENV = "HEARTH_KV_TRANSFER_SECRET_FILE"

# Options whose value is a secret -> the environment variable a child reads it from instead: `ps` shows
# command lines to every user of the machine.
SECRET_OPTIONS = {
    "--admin-key": ADMIN_KEY_ENV,
    "--kv-transfer-secret": KV_TRANSFER_SECRET_ENV,
    "--api-key": API_KEY_ENV,
}


def port_number(text: str) -> int:
    """A TCP port for argparse: 0 (any free port) to 65535. `--port 70000` used to listen on 70000 % 65536."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0-65535; 0 picks a free port)")
    return port


def add_listen_arguments(
    parser: Any,
    host_help: str = "address to bind (default: loopback only)",
    port_help: str = "port to bind (0: any free port)",
) -> None:
    """`--host` and `--port`. `parser`: an ArgumentParser or one of its groups."""
    parser.add_argument("--host", default=DEFAULT_HOST, help=host_help)
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help=port_help)


def add_log_level_argument(parser: Any, default: str, help: str | None = None) -> None:  # noqa: A002
    """`--log-level`: one spelling and one set of levels for every command; each keeps its own default
    (a server logs at info, the router, on every request's path, at warning)."""
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.lower,
        choices=LOG_LEVELS,
        help=help or f"how much to log (default: {default})",
    )


def add_page_size_argument(parser: Any, help: str, aliases: tuple[str, ...] = ()) -> None:  # noqa: A002
    """`--page-size` (for commands that do not build an engine config, whose page size is its own field)."""
    parser.add_argument(
        "--page-size", *aliases, dest="page_size", type=int, default=DEFAULT_PAGE_SIZE, help=help
    )


def add_kv_transfer_secret_arguments(parser: Any, what: str, with_value: bool = False) -> None:
    """`--kv-transfer-secret-file` (and, with `with_value`, `--kv-transfer-secret`): the deployment's KV
    transfer secret, which `what` uses."""
    if with_value:
        parser.add_argument(
            "--kv-transfer-secret",
            default=None,
            help=f"the deployment's shared KV transfer secret ({what}); visible in `ps`: prefer "
            f"--kv-transfer-secret-file or ${KV_TRANSFER_SECRET_ENV}",
        )
    parser.add_argument(
        "--kv-transfer-secret-file",
        default=None,
        metavar="FILE",
        help=f"file holding the deployment's KV transfer secret ({what}) "
        f"(default: ${KV_TRANSFER_SECRET_FILE_ENV}, then ${KV_TRANSFER_SECRET_ENV})",
    )


def add_admin_key_arguments(parser: Any, with_value: bool = True) -> None:
    """`--admin-key-file` (and, with `with_value`, `--admin-key`): the router's key for /admin/workers."""
    if with_value:
        parser.add_argument(
            "--admin-key",
            default=None,
            help=f"key for the router's /admin/workers; visible in `ps`: prefer --admin-key-file or "
            f"${ADMIN_KEY_ENV}. Admin is off without a key",
        )
    parser.add_argument(
        "--admin-key-file",
        default=None,
        metavar="FILE",
        help=f"file holding the router's admin key (default: ${ADMIN_KEY_FILE_ENV}, then ${ADMIN_KEY_ENV})",
    )
