"""`hearth launch`: a whole local deployment in one command, stopped together.

    hearth launch --model DIR --prefill 1 --decode 1 [--mixed N] [--port 8000]

starts the servers (`hearth serve --role ...`) on free loopback ports, waits until each says it is
healthy, then starts `hearth route` in front of them on `--port` and prints its URL. Each child's
output is printed with its name in front (`[prefill-0] ...`). Per-role options go through
`--prefill-args`, `--decode-args`, `--mixed-args` (e.g. a different `--kv-cache-dtype` or
`--max-num-seqs` per role) and `--server-args` (every server); `--router-args` reaches the router.

The deployment's KV transfer secret is made here (or taken from $HEARTH_KV_TRANSFER_SECRET or
`--kv-transfer-secret-file`) and handed to the servers and the router in their environment, as is the
router's admin key (`--admin-key-file`, $HEARTH_ROUTER_ADMIN_KEY). Secrets never reach a child's
command line, where `ps` shows them: `--admin-key`, `--kv-transfer-secret` and `--api-key` given in
`--*-args` are moved into the child's environment. Nothing is restarted silently: if a child exits, the
launcher says which and how, stops the rest and exits 1. Ctrl-C or SIGTERM stops every child
(SIGTERM, then SIGKILL after `--stop-timeout`); children also get SIGTERM from the kernel if the
launcher itself is killed (PR_SET_PDEATHSIG), so no server outlives it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from hearth.contracts.cli_common import (
    ADMIN_KEY_FILE_ENV,
    KV_TRANSFER_SECRET_ENV,
    KV_TRANSFER_SECRET_FILE_ENV,
    SECRET_OPTIONS,
    add_admin_key_arguments,
    add_kv_transfer_secret_arguments,
    add_listen_arguments,
)

HEALTH_POLL_S = 0.25
_PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the demo model)")
    parser.add_argument("--prefill", type=int, default=0, help="prefill servers")
    parser.add_argument("--decode", type=int, default=0, help="decode servers")
    parser.add_argument("--mixed", type=int, default=0, help="mixed servers")
    add_listen_arguments(parser, host_help="the router's address", port_help="the router's port")
    for role in ("prefill", "decode", "mixed", "server", "router"):
        what = "every server" if role == "server" else f"the {role} {'' if role == 'router' else 'servers'}"
        parser.add_argument(
            f"--{role}-args", default="", metavar="ARGS", help=f"extra options for {what} (one string)"
        )
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds servers get to become healthy"
    )
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds children get to stop")
    add_kv_transfer_secret_arguments(parser, "handed to every server and the router; default: a new one")
    add_admin_key_arguments(parser, with_value=False)


def secrets_to_env(options: list[str]) -> tuple[list[str], dict[str, str]]:
    """`options` without any secret-valued option, and those values as environment variables."""
    kept: list[str] = []
    env: dict[str, str] = {}
    index = 0
    while index < len(options):
        option = options[index]
        name, equals, value = option.partition("=")
        if name in SECRET_OPTIONS:
            if not equals:
                if index + 1 >= len(options):
                    raise ValueError(f"{name} needs a value")
                index += 1
                value = options[index]
            env[SECRET_OPTIONS[name]] = value
        else:
            kept.append(option)
        index += 1
    return kept, env


def _die_with_parent() -> None:
    """Runs in each child before exec: SIGTERM when the launcher dies, however it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    os.setpgrp()  # the launcher forwards Ctrl-C itself, once, in order


@dataclass
class Child:
    name: str
    command: list[str]
    url: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # secrets moved off the command line
    process: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = field(default=None, repr=False)

    def start(self, env: dict[str, str], out: IO[str]) -> None:
        self.process = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**env, **self.env},
            preexec_fn=_die_with_parent,
        )
        self.reader = threading.Thread(target=self._relay, args=(out,), name=f"log-{self.name}", daemon=True)
        self.reader.start()

    def _relay(self, out: IO[str]) -> None:
        assert self.process is not None and self.process.stdout is not None
        prefix = f"[{self.name}] "
        for line in iter(self.process.stdout.readline, b""):
            out.write(prefix + line.decode(errors="replace").rstrip("\n") + "\n")
            out.flush()

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def plan(args: argparse.Namespace) -> list[Child]:
    """The servers, then the router, as commands (ports chosen now)."""
    python = [sys.executable, "-m", "hearth.cli"]
    model = ["--model", args.model] if args.model else []
    servers: list[Child] = []
    for role, count, extra in (
        ("prefill", args.prefill, args.prefill_args),
        ("decode", args.decode, args.decode_args),
        ("mixed", args.mixed, args.mixed_args),
    ):
        for index in range(count):
            port = free_port()
            command = [*python, "serve", *model, "--host", "127.0.0.1", "--port", str(port), "--role", role]
            options, env = secrets_to_env(shlex.split(args.server_args) + shlex.split(extra))
            servers.append(Child(f"{role}-{index}", command + options, f"http://127.0.0.1:{port}", env))
    router = [*python, "route", "--host", args.host, "--port", str(args.port)]
    for server in servers:
        flag = {"prefill": "--prefill", "decode": "--decode", "mixed": "--worker"}[server.name.split("-")[0]]
        router += [flag, str(server.url)]
    options, env = secrets_to_env(shlex.split(args.router_args))
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    return [*servers, Child("router", router + options, f"http://{shown_host}:{args.port}", env)]


def run(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 0 or args.mixed < 0:
        print("hearth launch: server counts must be >= 0", file=sys.stderr)
        return 2
    if (args.prefill > 0) != (args.decode > 0):
        print(
            "hearth launch: prefill/decode disaggregation needs --prefill N and --decode M (both > 0)",
            file=sys.stderr,
        )
        return 2
    if args.prefill + args.decode + args.mixed == 0:
        print("hearth launch: nothing to launch; give --mixed N or --prefill N --decode M", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.kv_transfer_secret_file:
        env[KV_TRANSFER_SECRET_FILE_ENV] = os.path.abspath(args.kv_transfer_secret_file)
    elif not env.get(KV_TRANSFER_SECRET_FILE_ENV):
        env.setdefault(KV_TRANSFER_SECRET_ENV, secrets.token_hex(32))
    if args.admin_key_file:
        env[ADMIN_KEY_FILE_ENV] = os.path.abspath(args.admin_key_file)
    try:
        children = plan(args)
    except ValueError as exc:
        print(f"hearth launch: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    errors: list[str] = []  # why the deployment stopped on its own (empty: stopped by a signal)

    def on_signal(signum: int, frame: object) -> None:
        print(
            f"hearth launch: {signal.Signals(signum).name}; stopping every child", file=sys.stderr, flush=True
        )
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    out = sys.stdout
    try:
        servers, router = children[:-1], children[-1]
        for child in servers:
            child.start(env, out)
        if _wait_healthy(servers, args.ready_timeout, stop, errors):
            router.start(env, out)
            if _wait_healthy([router], 60.0, stop, errors):
                names = ", ".join(f"{c.name} {c.url}" for c in servers)
                print(f"hearth launch: ready at {router.url} ({names})", flush=True)
                while not stop.wait(0.5):
                    for child in children:
                        assert child.process is not None
                        if child.process.poll() is not None:
                            errors.append(f"{child.name} exited with code {child.process.returncode}")
                            stop.set()
                            break
        return 1 if errors else 0
    finally:
        if errors:
            print(f"hearth launch: {errors[0]}; stopping every child", file=sys.stderr, flush=True)
        _stop_all(children, args.stop_timeout)


def _wait_healthy(children: list[Child], timeout_s: float, stop: threading.Event, errors: list[str]) -> bool:
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            assert child.process is not None
            if child.process.poll() is not None:
                errors.append(f"{child.name} exited with code {child.process.returncode} while starting")
                return False
            if child.healthy():
                pending.remove(child)
        if not pending:
            return True
        if time.monotonic() > deadline:
            errors.append(f"{', '.join(c.name for c in pending)} not healthy after {timeout_s:.0f} s")
            return False
        if stop.wait(HEALTH_POLL_S):
            return False
    return True


def _stop_all(children: list[Child], timeout_s: float) -> None:
    """The router first (no new requests reach servers that are stopping), then every server."""
    started = [c for c in reversed(children) if c.process is not None and c.process.poll() is None]
    for child in started:
        assert child.process is not None
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in started:
        assert child.process is not None
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"hearth launch: {child.name} did not stop in {timeout_s:.0f} s; killing it", file=sys.stderr
            )
            child.process.kill()
            child.process.wait()
    for child in children:
        if child.reader is not None:
            child.reader.join(timeout=2)
