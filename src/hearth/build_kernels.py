"""`hearth build-kernels`: compile the CPU kernels now (at install, in an image build), so no server
start waits for them. Servers build them before they are ready when this has not been run."""

from __future__ import annotations

import argparse
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hearth.ops import cpu_kernels

    if not cpu_kernels.enabled():
        print("hearth build-kernels: HEARTH_CPU_KERNELS=0: nothing to build")
        return 0
    cpu_kernels.build_before_ready()
    if cpu_kernels.paged_decode_attention_kernel() is None:
        print("hearth build-kernels: the build failed (see the warning above); servers use the torch paths")
        return 1
    print(f"hearth build-kernels: {cpu_kernels.extension_name()} is ready")
    return 0
