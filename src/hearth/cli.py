"""The `hearth` command: one CLI, one module per subcommand, imported only when chosen.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Importing them
lazily keeps `hearth route` and `hearth bench serve` free of torch's import time.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (words on the command line) -> (module, one-line help)
SUBCOMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("serve",): ("hearth.server.cli", "run an OpenAI-compatible inference server"),
    ("route",): ("hearth.router.cli", "run the router in front of pools of servers"),
    ("launch",): ("hearth.launch", "run a local deployment: router + prefill/decode/mixed servers"),
    ("bench", "offline"): ("hearth.bench.offline", "offline engine throughput on random prompts"),
    ("bench", "serve"): ("hearth.bench.serve_cli", "load-test an OpenAI-compatible endpoint"),
    ("bench", "advise"): (
        "hearth.bench.advise",
        "recommend a prefill:decode ratio and batch limits from a trace",
    ),
    ("bench", "compare"): ("hearth.bench.compare", "print ratios between two bench result files"),
    ("bench", "side-by-side"): (
        "hearth.bench.side_by_side",
        "Hearth against vLLM-CPU on this machine, alternating: prefill, offline, serving",
    ),
    ("bench", "side-by-side-llama-cpp"): (
        "hearth.bench.side_by_side_llama_cpp",
        "Hearth against llama.cpp's llama-server on one GGUF, alternating",
    ),
    ("eval",): ("hearth.eval.cli", "quality of precision configurations against a reference"),
    ("build-kernels",): ("hearth.build_kernels", "compile the CPU kernels ahead of the first server start"),
}


def _usage() -> str:
    lines = ["usage: hearth <command> [options]", "", "commands:"]
    for words, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {' '.join(words):<16} {help_text}")
    lines.append("")
    lines.append("Run `hearth <command> --help` for a command's options; `hearth --version` for the version.")
    return "\n".join(lines)


def _match(argv: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    # Longest match first so "bench serve" wins over a hypothetical "bench".
    for words in sorted(SUBCOMMANDS, key=len, reverse=True):
        if tuple(argv[: len(words)]) == words:
            return words, argv[len(words) :]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version", "version"):
        import hearth

        print(f"hearth {hearth.__version__}")
        return 0
    matched = _match(argv)
    if matched is None:
        print(f"hearth: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    words, rest = matched
    module_name, help_text = SUBCOMMANDS[words]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog="hearth " + " ".join(words),
        description=help_text,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    module.add_arguments(parser)
    expand = getattr(module, "expand_config_file", None)  # `--config FILE` (hearth serve)
    if expand is not None:
        rest = expand(parser, rest)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
