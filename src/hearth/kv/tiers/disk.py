"""Local disk: a bounded LRU directory of page files that outlives the process.

Crash safety: a page is written to a temporary file in the same directory, then `os.replace`d onto its
name, so a file under a page's name is whole or absent after a process crash. After a power loss a
renamed file's data may still be missing (no fsync, by default: it would cost a disk flush per page);
the header's length and checksum catch that, and any file that fails them is deleted, never loaded.
Leftover temporary files are removed at start, and a failed write removes its own at once.

A full filesystem (ENOSPC: it is smaller than `--kv-disk-size`, or shared) lowers the tier's capacity to
what it holds, evicts the least recent pages to make room and retries once. Failures are counted
(`failed_writes`) and logged once per cause, then again only as their count doubles: a disk that keeps
failing costs a few log lines, not a traceback per page.

The index (key -> file size, LRU order) lives in memory, rebuilt at start from the directory (oldest
modification first), so lookups cost no I/O. Two servers should not share one directory: each sees
the other's files only after a restart.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from hearth.kv.tiers.base import KVTier, Page
from hearth.kv.tiers.blob_auth import BlobMAC, local_key
from hearth.kv.tiers.page_format import PageFormatError, PageSpec, decode_page, encode_page

logger = logging.getLogger("hearth.kv.tiers")

SUFFIX = ".kvpage"
TMP_SUFFIX = ".tmp"


class DiskTier(KVTier):
    name = "disk"

    def __init__(
        self,
        spec: PageSpec,
        directory: str | Path,
        capacity_bytes: int,
        fsync: bool = False,
        mac: BlobMAC | None = None,
    ) -> None:
        super().__init__(spec)
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._failures: dict[str, int] = {}  # cause -> failed writes, for the log
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recent first
        self._used_bytes = 0
        self._lock = threading.Lock()
        self.directory.mkdir(parents=True, exist_ok=True)
        # Files are MAC'd (blob_auth): with the deployment secret, else with the directory's own key.
        self.mac = mac if mac is not None else BlobMAC(local_key(self.directory))
        self._scan()

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for path in self.directory.glob("*/*"):
            if path.name.endswith(TMP_SUFFIX):  # a write that never finished
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._used_bytes += size
        self._evict_over_capacity()
        if found:
            logger.info(
                "disk tier %s: %d pages (%d bytes) from before", self.directory, len(found), self._used_bytes
            )

    def lookup(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            found = 0
            for key in keys:
                if key not in self._index:
                    break
                found += 1
            return found

    def load(self, keys: Sequence[bytes]) -> list[Page]:
        pages: list[Page] = []
        for key in keys:
            with self._lock:
                if key not in self._index:
                    break
                self._index.move_to_end(key)
            try:
                blob = self.path(key).read_bytes()
                pages.append(decode_page(self.spec, key, self.mac.open(key, blob)))
            except FileNotFoundError:
                self._forget(key)
                break
            except PageFormatError as exc:
                logger.warning("disk tier: dropping damaged page file %s: %s", self.path(key), exc)
                self.stats.add(invalid_pages=1)
                self._forget(key, unlink=True)
                break
        return pages

    def store(self, items: Sequence[tuple[bytes, Page]]) -> None:
        for key, page in items:
            with self._lock:
                if key in self._index:
                    self._index.move_to_end(key)
                    continue
            blob = self.mac.seal(key, encode_page(self.spec, key, page))
            if not self._write(self.path(key), blob):
                continue
            with self._lock:
                self._index[key] = len(blob)
                self._used_bytes += len(blob)
                self._evict_over_capacity()

    def _write(self, path: Path, blob: bytes) -> bool:
        """`blob` under `path`, whole or not at all; False (counted, logged by cause) if it failed."""
        for attempt in range(2):
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
            try:
                path.parent.mkdir(exist_ok=True)
                self._write_file(tmp, blob)
                os.replace(tmp, path)  # atomic: readers see the whole file or none
                return True
            except OSError as exc:
                tmp.unlink(missing_ok=True)  # never leave a partial page behind
                if exc.errno == errno.ENOSPC and attempt == 0 and self._make_room(len(blob)):
                    continue
                self.stats.add(failed_writes=1)
                self._note_failure(errno.errorcode.get(exc.errno or 0, type(exc).__name__), exc)
                return False
        return False

    def _write_file(self, tmp: Path, blob: bytes) -> None:
        with open(tmp, "wb") as file:
            file.write(blob)
            if self.fsync:
                file.flush()
                os.fsync(file.fileno())

    def _make_room(self, needed_bytes: int) -> bool:
        """The filesystem is full: hold no more than now, minus room for a few pages. True if it evicted."""
        with self._lock:
            lowered = max(0, self._used_bytes - 4 * needed_bytes)
            if not self._index or lowered >= self.capacity_bytes:
                return False
            logger.warning(
                "disk tier %s: the filesystem is full; capacity lowered from %d to %d bytes",
                self.directory,
                self.capacity_bytes,
                lowered,
            )
            self.capacity_bytes = lowered
            self._evict_over_capacity()
            return True

    def _note_failure(self, cause: str, exc: OSError) -> None:
        with self._lock:
            count = self._failures[cause] = self._failures.get(cause, 0) + 1
        if count & (count - 1) == 0:  # 1, 2, 4, 8, ...: one line per cause, then as its count doubles
            logger.warning(
                "disk tier %s: %d page write(s) failed with %s (%s); those pages are not kept",
                self.directory,
                count,
                cause,
                exc.strerror or exc,
            )

    def _evict_over_capacity(self) -> None:
        while self._used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._used_bytes -= size
            self.path(key).unlink(missing_ok=True)

    def _forget(self, key: bytes, unlink: bool = False) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used_bytes -= size
        if unlink:
            self.path(key).unlink(missing_ok=True)

    def knows(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._index), self._used_bytes
