"""The CPU-kernel builder's lifecycle (hearth.ops.cpu_kernels): keyed by the sources, and no builder
(or compiler) outlives the server that started it. The compile itself is replaced by a stand-in that
starts a long-running "compiler" in its process group."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from hearth.ops import cpu_kernels

# Stands in for torch's build: a compiler that would run for minutes, then waiting on it.
FAKE_WORK = """
import subprocess, time
open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], sys.argv[1] + ".started"), "w").write(str(subprocess.Popen(["sleep", "300"]).pid))
time.sleep(300)
"""


def test_the_build_key_follows_the_sources_not_the_checkout(tmp_path: Path, monkeypatch) -> None:
    here = Path(cpu_kernels.__file__).parent / "csrc"
    for checkout in ("a", "b"):
        shutil.copytree(here, tmp_path / checkout / "csrc")
    original = cpu_kernels.extension_name()

    def name_of(checkout: str) -> str:
        sources = [tmp_path / checkout / "csrc" / path.name for path in cpu_kernels._SOURCES]
        monkeypatch.setattr(cpu_kernels, "_SOURCES", sources)
        monkeypatch.setattr(cpu_kernels, "__file__", str(tmp_path / checkout / "cpu_kernels.py"))
        return cpu_kernels.extension_name()

    assert name_of("a") == name_of("b") == original  # two checkouts, one build
    with open(tmp_path / "b" / "csrc" / "rms_norm.cpp", "a") as file:
        file.write("\n// changed\n")
    assert name_of("b") != name_of("a")  # another version: its own build, neither overwrites the other
    (tmp_path / "a" / "csrc" / "fp8_e4m3.h").write_text("// a header changed too\n")
    assert name_of("a") not in (original, name_of("b"))


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_builder_and_its_compiler_die_with_the_server_that_started_them(tmp_path: Path) -> None:
    """Issue 30: after SIGTERM to `hearth serve`, the kernel builder lived on (an orphan, compiling)."""
    script = textwrap.dedent(
        f"""
        import threading
        from hearth.ops import cpu_kernels
        cpu_kernels._BUILD_WORK = {FAKE_WORK!r}
        threading.Thread(target=cpu_kernels._compile, args=("hearth_builder_test", []), daemon=True).start()
        threading.Event().wait()
        """
    )
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    server = subprocess.Popen([sys.executable, "-c", script], env=env)
    marker = tmp_path / "hearth_builder_test.started"
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.05)
        compiler = int(marker.read_text())
        (builder,) = psutil.Process(server.pid).children()
        server.send_signal(signal.SIGTERM)  # the default action: the server exits at once
        server.wait(10)
        assert _gone(builder.pid), "the builder outlived its server"
        assert _gone(compiler), "the compiler outlived its builder"
    finally:
        if server.poll() is None:
            server.kill()


def test_stop_builds_stops_a_build_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_BUILD_WORK", FAKE_WORK)
    failures: list[Exception] = []

    def build() -> None:
        try:
            cpu_kernels._compile("hearth_stop_test", [])
        except RuntimeError as exc:
            failures.append(exc)

    thread = threading.Thread(target=build)
    thread.start()
    marker = tmp_path / "hearth_stop_test.started"
    deadline = time.monotonic() + 60
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    compiler = int(marker.read_text())
    cpu_kernels.stop_builds()
    thread.join(10)
    assert not thread.is_alive() and failures  # the build ended, as a failure (the torch paths serve)
    assert _gone(compiler)


def test_two_checkouts_compile_the_same_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ninja rebuilds when a compile command changes, and a source's path is in its command: both
    checkouts compile copies inside the build directory, so neither rebuilds the other's kernels."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    here = Path(cpu_kernels.__file__).parent / "csrc"
    staged = []
    for checkout in ("a", "b"):
        shutil.copytree(here, tmp_path / checkout / "csrc")
        sources = [tmp_path / checkout / "csrc" / path.name for path in cpu_kernels._SOURCES]
        monkeypatch.setattr(cpu_kernels, "_SOURCES", sources)
        monkeypatch.setattr(cpu_kernels, "__file__", str(tmp_path / checkout / "cpu_kernels.py"))
        staged.append(cpu_kernels._staged_sources("hearth_staging_test"))
    assert staged[0] == staged[1] and all(str(tmp_path / "ext") in str(path) for path in staged[0])
    assert (staged[0][0].parent / "fp8_e4m3.h").read_bytes() == (here / "fp8_e4m3.h").read_bytes()
    assert [path.read_bytes() for path in staged[0]] == [
        (here / path.name).read_bytes() for path in staged[0]
    ]


def test_a_live_builders_lock_is_kept_however_old_and_a_dead_ones_is_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build on a loaded machine took longer than the old 300 s staleness rule, and another start
    deleted its lock mid-build (the build then failed at release)."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = Path(_get_build_directory("hearth_lock_test", verbose=False))
    lock, owner = directory / "lock", directory / cpu_kernels.BUILDER_PID_FILE
    old = time.time() - 3600

    def locked(pid: int | None) -> bool:
        lock.touch()
        os.utime(lock, (old, old))
        if pid is None:
            owner.unlink(missing_ok=True)
        else:
            owner.write_text(str(pid))
        cpu_kernels._clear_stale_lock("hearth_lock_test")
        return lock.exists()

    assert locked(os.getpid())  # an hour-old lock of a live builder stays
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not locked(dead.pid)  # its builder is gone: cleared
    assert not locked(None)  # no owner recorded and old: cleared
    lock.touch()  # no owner recorded, but fresh: kept
    cpu_kernels._clear_stale_lock("hearth_lock_test")
    assert lock.exists()
