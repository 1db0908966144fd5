"""Keyed MACs on stored page blobs: a page read back from disk or a shared store is used only if a holder
of the deployment secret wrote it for exactly this key.

The blob (`page_format`) already names its key, layout tag and payload; the prefix key itself is a hash
chain from a salt that covers the model, the KV layout and the tenant, so a MAC over (the key asked for,
the whole blob) binds the page to its key, layout, tenant salt and bytes. Anyone who can write to Redis
(or the store, or the directory) but lacks the secret can only make pages that fail here: they are
counted invalid and recomputed, never served.

    sealed blob = "HKVA" | salt 16 B | tag 16 B | blob

The tag is GMAC (AES-256-GCM, no plaintext) under a key derived per blob from the secret and the random
salt (HMAC-SHA256), so no key ever sees a second nonce however many blobs are written; GMAC runs at
memory speed, so authenticating a page costs about what its checksum does.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from hearth.kv.tiers.page_format import PageFormatError

MAGIC = b"HKVA"
SALT_BYTES = 16
TAG_BYTES = 16
OVERHEAD_BYTES = len(MAGIC) + SALT_BYTES + TAG_BYTES
_ZERO_NONCE = bytes(12)
KEY_FILE = ".hearth-blob-key"  # a disk tier's own key when the deployment has no secret


class BlobAuthError(PageFormatError):
    """A stored blob without a valid MAC for the key it was read under."""


class BlobMAC:
    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ValueError("a blob MAC needs a non-empty secret")
        self._secret = secret

    def _tag(self, salt: bytes, key: bytes, blob: bytes | memoryview) -> bytes:
        blob_key = hmac.new(self._secret, b"hearth-kv-blob-v1" + salt, hashlib.sha256).digest()
        context = Cipher(algorithms.AES(blob_key), modes.GCM(_ZERO_NONCE)).encryptor()
        context.authenticate_additional_data(len(key).to_bytes(2, "big") + key)
        context.authenticate_additional_data(blob)
        context.finalize()
        return context.tag

    def seal(self, key: bytes, blob: bytes) -> bytes:
        salt = secrets.token_bytes(SALT_BYTES)
        return MAGIC + salt + self._tag(salt, key, blob) + blob

    def open(self, key: bytes, sealed: bytes | bytearray | memoryview) -> memoryview:
        """The blob inside `sealed`, if its MAC is valid for `key`; BlobAuthError otherwise."""
        view = memoryview(sealed)
        if len(view) < OVERHEAD_BYTES or bytes(view[: len(MAGIC)]) != MAGIC:
            raise BlobAuthError("page blob carries no MAC (written without this deployment's secret)")
        salt = bytes(view[len(MAGIC) : len(MAGIC) + SALT_BYTES])
        tag = bytes(view[len(MAGIC) + SALT_BYTES : OVERHEAD_BYTES])
        blob = view[OVERHEAD_BYTES:]
        if not hmac.compare_digest(tag, self._tag(salt, key, blob)):
            raise BlobAuthError("page blob MAC mismatch: not written for this key by this deployment")
        return blob


def local_key(directory: Path) -> bytes:
    """A directory's own random key (created once, owner-only): a disk tier's MAC key when the deployment
    has no secret, so its files still verify after a restart."""
    path = directory / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) < 32:
            raise ValueError(
                f"{path} is damaged: remove it (the disk tier's pages are then recomputed)"
            ) from None
        return key
    with os.fdopen(fd, "wb") as file:
        file.write(secrets.token_bytes(32))
    return path.read_bytes()
