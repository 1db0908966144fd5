"""Compiled CPU kernels (C++ through torch's extension builder), built in the background.

- The paged decode attention kernel reads keys and values in place from their pages, one sequence
  per work item, where the torch path first gathers them into contiguous tensors: 2-3x faster on
  its own, decode steps 0.8-0.9x as long at 128-256 tokens of context and 0.3x at 1,024.
- The bf16 skinny linear multiplies a few float32 rows by a bfloat16 weight: small-batch decode
  reads half the weight bytes of a float32 copy (docs/benchmarks.md).
- RMSNorm, fused with the residual add before it: one call instead of ~9 small torch ops.
- RoPE on the fused qkv projection with the KV write: one call instead of ~25 small torch ops.
- Prefill attention on tiles (AVX512-BF16 or AVX-512): a prompt chunk against its paged context, flash-style,
  several times torch's CPU SDPA over gathered pages (`csrc/prefill_attention.cpp`).

Building takes ~60 s the first time on a machine (5-10 min on a busy one) and is cached under torch's
extension directory, keyed by the CPU's features and a hash of the kernel sources, flags and torch
version: two checkouts with the same sources share one build, and different sources never overwrite
each other's. The build runs before the server says it is ready (`build_before_ready`, with a progress
line), never beside serving; `hearth build-kernels` (or any first start) builds it ahead of time.
`HEARTH_CPU_KERNELS=0` turns the kernels off; a failed build only logs a warning (the torch paths serve).

The compiler runs in a child process (its own process group, so torch's lock file is released and no
compiler is left behind when it stops) that dies with its server: it gets SIGTERM when the process that
started it exits, however that happens, and stops its compilers with it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "bindings.cpp",
        "paged_decode_attention.cpp",
        "bf16_skinny_linear.cpp",
        "rms_norm.cpp",
        "rotary_write_kv.cpp",
        "int4_skinny_linear.cpp",
        "int8_skinny_linear.cpp",
        "decode_stack.cpp",
        "page_tags.cpp",
        "prefill_attention.cpp",
        "dequantize_bf16.cpp",
        "silu_and_mul.cpp",
    )
]
# Vectorized float reductions need reassociation; finite-math is not assumed (masks use -inf).
_CFLAGS = [
    "-O3",
    "-fopenmp",  # at::parallel_for is OpenMP inline code: without it every kernel runs on one thread
    "-march=native",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
]

BUILDER_PID_FILE = "hearth-builder.pid"
_STALE_LOCK_S = 300  # a lock this old with no builder pid file is taken as left by a dead builder

_lock = threading.Lock()
_kernel: Callable[..., object] | None = None  # paged decode attention
_skinny_linear: Callable[..., object] | None = None
_rms_norm: Callable[..., object] | None = None
_rotary_write_kv: Callable[..., object] | None = None
_paged_decode_attention_fp8: Callable[..., object] | None = None
_rotary_write_kv_fp8: Callable[..., object] | None = None
_int4_skinny_linear: Callable[..., object] | None = None
_int8_skinny_linear: Callable[..., object] | None = None
_decode_stack_module: Any = None  # the extension module, for its DecodeStack / DecodeLinear classes
_paged_decode_attention_bf16: Callable[..., object] | None = None
_check_page_tags: Callable[..., list[int]] | None = None
_prefill_attention: Callable[..., Any] | None = None
_prefill_attention_isa: Callable[[Any], str] | None = None
_prefill_attention_isas: dict[Any, str] = {}
_int4_dequantize_bf16: Callable[..., Any] | None = None
_int8_dequantize_bf16: Callable[..., Any] | None = None
_rotary_write_kv_bf16: Callable[..., Any] | None = None
_silu_and_mul_bf16: Callable[..., Any] | None = None
_build_thread: threading.Thread | None = None
_builders: set[subprocess.Popen[bytes]] = set()  # compiler processes running now
PROGRESS_INTERVAL_S = 30.0
LOAD_S = 5.0


def _cpu_tag() -> str:
    # -march=native binaries must not be reused on a CPU with other features.
    try:
        flags = next(
            (line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), ""
        )
    except OSError:
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _source_tag() -> str:
    """The build's inputs: sources (and the headers beside them), flags, torch and Python versions."""
    import torch

    digest = hashlib.sha256()
    for path in sorted({*_SOURCES, *(Path(__file__).parent / "csrc").glob("*.h")}):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    # "staged": compiled from copies in the build directory (`_staged_sources`), a build of its own.
    digest.update(repr((_CFLAGS, torch.__version__, sys.version_info[:2], "staged")).encode())
    return digest.hexdigest()[:12]


def extension_name() -> str:
    return f"hearth_cpu_kernels_{_cpu_tag()}_{_source_tag()}"


def enabled() -> bool:
    return os.environ.get("HEARTH_CPU_KERNELS", "1") != "0"


def _clear_stale_lock(name: str) -> None:
    """torch's builder waits forever on a lock file left by a builder killed mid-build (SIGKILL: on
    SIGTERM it releases it). A lock is stale when the builder that wrote `BUILDER_PID_FILE` is gone; a
    lock with no such file (an older Hearth, or torch used directly) only after `_STALE_LOCK_S`. A live
    builder's lock is never taken, however long a loaded machine makes its build."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, verbose=False))
    lock = directory / "lock"
    try:
        age_s = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    try:
        owner: int | None = int((directory / BUILDER_PID_FILE).read_text())
    except (FileNotFoundError, ValueError):
        owner = None
    if owner is not None:
        try:
            os.kill(owner, 0)
            return  # still building
        except ProcessLookupError:
            pass
        except PermissionError:
            return
    elif age_s <= _STALE_LOCK_S:
        return
    lock.unlink(missing_ok=True)


def _staged_sources(name: str) -> list[Path]:
    """The sources (and headers), copied into the build's own directory: the compile commands then name
    no checkout, so every checkout with these sources finds the build up to date (ninja rebuilds when a
    command changes, and a source's path is part of its command)."""
    from torch.utils.cpp_extension import _get_build_directory

    staged = Path(_get_build_directory(name, verbose=False)) / "src"
    staged.mkdir(exist_ok=True)
    csrc = Path(__file__).parent / "csrc"
    for path in sorted({*_SOURCES, *csrc.glob("*.h")}):
        target = staged / path.name
        data = path.read_bytes()
        if not target.exists() or target.read_bytes() != data:
            tmp = target.with_name(f".{target.name}.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, target)  # the name's hash covers these bytes: any copy is the same file
    return [staged / path.name for path in _SOURCES]


def _compile(name: str, sources: list[Path]) -> None:
    """Compile (or find up to date) the extension in a child process that dies with us.

    torch's builder holds a lock file while it compiles; the child releases it on SIGTERM (torch's
    `finally`), and sends its process group (ninja and the compilers) SIGTERM on its way out.
    """
    from torch.utils.cpp_extension import _get_build_directory

    log = Path(_get_build_directory(name, verbose=False)) / "hearth-build.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-c", _BUILD_SNIPPET, name, repr(_CFLAGS), *map(str, sources), _BUILD_WORK],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopped as one (the builder and its compilers)
            preexec_fn=_die_with_parent,
        )
        (log.parent / BUILDER_PID_FILE).write_text(str(process.pid))  # who holds torch's lock, if anyone
        with _lock:
            _builders.add(process)
        try:
            code = process.wait()
        finally:
            with _lock:
                _builders.discard(process)
    if code != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise RuntimeError(lines[-1] if lines else f"build exited with {code}")


def _die_with_parent() -> None:
    """In the builder before exec: SIGTERM when the process that started it exits (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def stop_builds() -> None:
    """Stop any build under way (a server stopping): the builder releases torch's lock and stops its
    compilers; the next start builds again."""
    with _lock:
        builders = list(_builders)
    for process in builders:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass


# SIGTERM (from `stop_builds`, or PR_SET_PDEATHSIG when its server exits) raises SystemExit: torch's
# `finally` releases its lock and `subprocess.run` kills ninja; then the rest of the group (compilers)
# is stopped. A parent already gone before the handler was set is caught by the ppid check.
_BUILD_WORK = """
from torch.utils.cpp_extension import load
load(name=sys.argv[1], sources=sys.argv[3:], extra_cflags=ast.literal_eval(sys.argv[2]), verbose=False)
"""
_BUILD_SNIPPET = """
import ast, os, signal, sys
def stop(signum, frame):
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
if os.getppid() == 1:
    sys.exit(143)
try:
    exec(sys.argv.pop(-1))
finally:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
"""


def _build() -> None:
    global \
        _kernel, \
        _skinny_linear, \
        _rms_norm, \
        _rotary_write_kv, \
        _paged_decode_attention_fp8, \
        _rotary_write_kv_fp8
    global _int4_skinny_linear, _int8_skinny_linear, _paged_decode_attention_bf16, _check_page_tags
    global _decode_stack_module, _prefill_attention, _prefill_attention_isa
    global _int4_dequantize_bf16, _int8_dequantize_bf16, _rotary_write_kv_bf16, _silu_and_mul_bf16
    try:
        from torch.utils.cpp_extension import load

        name = extension_name()
        _clear_stale_lock(name)
        sources = _staged_sources(name)
        _compile(name, sources)
        # Up to date now: this only loads the library.
        module = load(
            name=name,
            sources=[str(path) for path in sources],
            extra_cflags=_CFLAGS,
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: the torch path stays
        logger.warning("CPU kernels unavailable (%s); using the torch paths", str(exc).splitlines()[0])
        return
    _kernel = module.paged_decode_attention
    _skinny_linear = module.bf16_skinny_linear
    _rms_norm = module.rms_norm
    _rotary_write_kv = module.rotary_write_kv
    _paged_decode_attention_fp8 = module.paged_decode_attention_fp8
    _rotary_write_kv_fp8 = module.rotary_write_kv_fp8
    _int4_skinny_linear = module.int4_skinny_linear
    _int8_skinny_linear = module.int8_skinny_linear
    _decode_stack_module = module
    _paged_decode_attention_bf16 = module.paged_decode_attention_bf16
    _check_page_tags = module.check_page_tags
    _prefill_attention = module.prefill_attention
    _prefill_attention_isa = module.prefill_attention_isa
    _int4_dequantize_bf16 = module.int4_dequantize_bf16
    _int8_dequantize_bf16 = module.int8_dequantize_bf16
    _rotary_write_kv_bf16 = module.rotary_write_kv_bf16
    _silu_and_mul_bf16 = module.silu_and_mul_bf16
    logger.info("CPU kernels ready (paged decode attention, bf16 skinny linear, RMSNorm, rotary + KV write)")


def start_build() -> None:
    """Start building (or loading the cached build) in the background; returns at once."""
    global _build_thread
    if not enabled():
        return
    with _lock:
        if _build_thread is None:
            _build_thread = threading.Thread(target=_build, name="hearth-kernel-build", daemon=True)
            _build_thread.start()


def build_before_ready() -> None:
    """Build (or load) the kernels now, with progress lines while a build runs: a server is ready only
    after this, so a compile never competes with serving."""
    if not enabled():
        return
    started = time.monotonic()
    start_build()
    assert _build_thread is not None
    _build_thread.join(LOAD_S)  # loading a build that is up to date takes about this long
    if not _build_thread.is_alive():
        return
    logger.warning(
        "preparing the CPU kernels (a build, once per CPU and source version, takes 1-10 min); "
        "the server is ready after it (`hearth build-kernels` does it ahead of time, HEARTH_CPU_KERNELS=0 "
        "skips the kernels)"
    )
    while _build_thread.is_alive():
        _build_thread.join(PROGRESS_INTERVAL_S)
        if _build_thread.is_alive():
            logger.warning("still building the CPU kernels (%.0f s so far)", time.monotonic() - started)
    if _kernel is not None:  # else the failure was logged, and the torch paths serve
        logger.warning("CPU kernels built in %.0f s", time.monotonic() - started)


def paged_decode_attention_kernel(wait: bool = False) -> Callable[..., object] | None:
    """The compiled kernel if it is ready (or, with `wait`, once the build ends); else None."""
    if wait:
        start_build()
        if _build_thread is not None:
            _build_thread.join()
    return _kernel


def bf16_skinny_linear_kernel(wait: bool = False) -> Callable[..., object] | None:
    """`bf16_skinny_linear(x, weight, bias=None)` once built (or, with `wait`, once the build ends); else None."""
    if wait:
        paged_decode_attention_kernel(wait=True)
    return _skinny_linear


def rms_norm_kernel() -> Callable[..., object] | None:
    """`rms_norm(x, weight, eps, residual=None) -> (out, x + residual)` once built; else None."""
    return _rms_norm


def rotary_write_kv_kernel() -> Callable[..., object] | None:
    """`rotary_write_kv(qkv, cos, sin, heads, k_pool, v_pool, slot_mapping) -> q` once built; else None."""
    return _rotary_write_kv


def paged_decode_attention_fp8_kernel() -> Callable[..., object] | None:
    """`paged_decode_attention_fp8(q, k_pool, v_pool, k_scale, v_scale, page_table, lens, firsts, page_size,
    scale)` over float8_e4m3fn pools once built; else None."""
    return _paged_decode_attention_fp8


def rotary_write_kv_fp8_kernel() -> Callable[..., object] | None:
    """`rotary_write_kv_fp8(qkv, cos, sin, heads, k_pool, v_pool, slot_mapping, k_scale, v_scale) -> q` once
    built; else None."""
    return _rotary_write_kv_fp8


def int4_skinny_linear_kernel() -> Callable[..., object] | None:
    """`int4_skinny_linear(x, packed, scales, zero_scaled, group_size, bias=None, int8_activations=False)` once
    built; else None."""
    return _int4_skinny_linear


def int8_skinny_linear_kernel() -> Callable[..., object] | None:
    """`int8_skinny_linear(x, q, scales, group_size, bias=None)` once built; else None."""
    return _int8_skinny_linear


def decode_stack_classes() -> tuple[Any, Any] | None:
    """`(DecodeStack, DecodeLinear)` (`csrc/decode_stack.h`: every layer of a dense decode step in one call)
    once built; else None."""
    module = _decode_stack_module
    return None if module is None else (module.DecodeStack, module.DecodeLinear)


def paged_decode_attention_bf16_kernel() -> Callable[..., object] | None:
    """`paged_decode_attention_bf16(q, k_pool, v_pool, page_table, lens, firsts, page_size, scale)`: float32
    queries over bfloat16 pools read in place, once built; else None."""
    return _paged_decode_attention_bf16


def check_page_tags_kernel() -> Callable[..., list[int]] | None:
    """`check_page_tags(pool_tags, page_table, expected_tags, padding_tag) -> [flat index, ...]` over the
    step's int lists (the KV integrity check, `hearth.kv.integrity`) once built; else None."""
    return _check_page_tags


def prefill_attention_kernel(dtype: Any) -> Callable[..., Any] | None:
    """`prefill_attention(q, k_pool, v_pool, k_scale, v_scale, page_ids, context_len, page_size, window, scale)`
    for queries of `dtype` (a torch dtype) once built, where this build has tile math for it (AVX512-BF16 for
    bfloat16, AVX-512 for float32); else None (older CPUs: the torch path)."""
    if _prefill_attention is None or _prefill_attention_isa is None:
        return None
    if dtype not in _prefill_attention_isas:  # asked per layer: the build's answer, once per dtype
        _prefill_attention_isas[dtype] = _prefill_attention_isa(dtype)
    return _prefill_attention if _prefill_attention_isas[dtype] else None


def int4_dequantize_bf16_kernel() -> Callable[..., Any] | None:
    """`int4_dequantize_bf16(packed, scales, zero_scaled, group_size) -> bf16 [out, in]` once built; else None."""
    return _int4_dequantize_bf16


def int8_dequantize_bf16_kernel() -> Callable[..., Any] | None:
    """`int8_dequantize_bf16(q, scales, group_size) -> bf16 [out, in]` once built; else None."""
    return _int8_dequantize_bf16


def rotary_write_kv_bf16_kernel() -> Callable[..., Any] | None:
    """`rotary_write_kv_bf16(qkv, cos, sin, heads, k_pool, v_pool, slot_mapping) -> q` (all bf16) once built; else
    None."""
    return _rotary_write_kv_bf16


def silu_and_mul_bf16_kernel() -> Callable[..., Any] | None:
    """`silu_and_mul_bf16(gate_up) -> silu(gate) * up` for bf16 rows once built; else None."""
    return _silu_and_mul_bf16
