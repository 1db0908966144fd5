"""Who may move KV: the deployment secret, the router's signed instructions, and per-transfer frame MACs.

Three things are authenticated with the deployment's KV transfer secret (docs/pd-protocol.md, "Trust"):

- **Instructions.** A server follows a `kv_transfer` field only if the router signed it: an HMAC-SHA256
  over the role, the transfer id, the peer URL it names and an expiry. A client can therefore neither
  point a prefill server at a decode server of its choosing nor open a receive on a decode server.
- **The handshake.** Both ends prove they hold the secret with an HMAC over the transfer id, both nonces
  and what they announce (layout, prompt hash, token count, FP8 scales), as TLS-PSK does with its
  Finished messages.
- **Every frame after it.** Each direction of a transfer gets its own key, derived (HKDF-SHA256, RFC 5869)
  from the secret, the transfer id and both nonces; every frame carries a GMAC tag (AES-256-GCM with no
  plaintext) under that key with the frame's sequence number as nonce, over the frame's header and the
  page bytes that follow it. A peer that relays someone else's handshake holds no key, so the pages it
  sends are refused; a replayed or reordered frame fails its sequence number. GMAC runs at memory speed
  (~20 GB/s with AES-NI + PCLMUL), where HMAC-SHA256 would halve the transfer rate; keys are never
  reused, so its one-nonce-per-key rule holds by construction.

Pages received under a frame are only handed on (and only enter a prefix cache) after its tag verified.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections.abc import Sequence
from pathlib import Path

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from hearth.contracts.cli_common import KV_TRANSFER_SECRET_ENV, KV_TRANSFER_SECRET_FILE_ENV

SECRET_ENV = KV_TRANSFER_SECRET_ENV
SECRET_FILE_ENV = KV_TRANSFER_SECRET_FILE_ENV
NONCE_BYTES = 32
TAG_BYTES = 16
TRANSFER_ID_HEX = 32  # the router's transfer ids: 16 random bytes in lowercase hex
INSTRUCTION_TTL_S = 300  # a signed instruction is honoured this long (the router signs it just before use)
_TRANSFER_ID = re.compile(rf"[0-9a-f]{{{TRANSFER_ID_HEX}}}")
_BuffersLike = Sequence[bytes | bytearray | memoryview]


class FrameAuthError(ValueError):
    """A frame's tag did not verify: it was not sent by the holder of this transfer's key."""


class MissingSecretError(ValueError):
    pass


def read_secret(env: str, file_env: str, path: str | None = None) -> str | None:
    """A secret from a file (`path`, else `$file_env`) or from `$env`; None if none is given. A file's
    trailing newline is not part of the secret. Files keep secrets out of argv and out of `ps`."""
    path = path or os.environ.get(file_env) or None
    if path:
        try:
            text = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise MissingSecretError(f"cannot read the secret file {path}: {exc.strerror or exc}") from exc
        if not text:
            raise MissingSecretError(f"the secret file {path} is empty")
        return text
    return os.environ.get(env) or None


def deployment_secret() -> bytes:
    """The KV transfer secret every server and the router of a deployment share."""
    secret = read_secret(SECRET_ENV, SECRET_FILE_ENV)
    if not secret:
        raise MissingSecretError(
            "prefill and decode servers (and a router in front of them) need the deployment's KV transfer "
            f"secret: pass --kv-transfer-secret-file FILE or set ${SECRET_ENV} or ${SECRET_FILE_ENV} "
            "(the same value everywhere; `hearth launch` makes one)"
        )
    return secret.encode()


def is_transfer_id(text: object) -> bool:
    """A transfer id as the router makes them; anything else is refused before it is stored or logged."""
    return isinstance(text, str) and _TRANSFER_ID.fullmatch(text) is not None


# ---- the router's instructions -------------------------------------------------------------------


def _instruction_mac(secret: bytes, role: str, transfer_id: str, peer_url: str, expires: int) -> str:
    message = "\0".join(("hearth-pd-instruction-v1", role, transfer_id, peer_url, str(expires)))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def sign_instruction(
    secret: bytes, role: str, transfer_id: str, peer_url: str, now_s: float | None = None
) -> dict[str, object]:
    """The `expires` and `signature` fields the router adds to a `kv_transfer` instruction."""
    expires = int((time.time() if now_s is None else now_s) + INSTRUCTION_TTL_S)
    return {"expires": expires, "signature": _instruction_mac(secret, role, transfer_id, peer_url, expires)}


def instruction_refusal(
    secret: bytes,
    role: str,
    transfer_id: str,
    peer_url: str,
    expires: int | None,
    signature: str | None,
    now_s: float | None = None,
) -> str | None:
    """Why a `kv_transfer` instruction is not the router's, or None if it is."""
    if not is_transfer_id(transfer_id):
        return f"kv_transfer.transfer_id must be {TRANSFER_ID_HEX} lowercase hex characters"
    if signature is None or expires is None:
        return "kv_transfer instructions are accepted only from the router (no signature)"
    expected = _instruction_mac(secret, role, transfer_id, peer_url, expires)
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
        return "kv_transfer instructions are accepted only from the router (bad signature)"
    if (time.time() if now_s is None else now_s) > expires:
        return "kv_transfer instruction expired"
    return None


# ---- the transfer handshake ----------------------------------------------------------------------


def handshake_mac(
    secret: bytes, label: bytes, transfer_id: str, sender_nonce: bytes, receiver_nonce: bytes, body: bytes
) -> bytes:
    """One side's proof: `label` names the side, `body` is what it announces (encoded, MAC field empty)."""
    message = b"\0".join((b"hearth-kv-v2", label, transfer_id.encode(), sender_nonce, receiver_nonce, body))
    return hmac.new(secret, message, hashlib.sha256).digest()


def _hkdf(secret: bytes, salt: bytes, info: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869) with one block of output: 32 bytes, an AES-256 key."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()


def session_keys(
    secret: bytes, transfer_id: str, sender_nonce: bytes, receiver_nonce: bytes
) -> tuple[bytes, bytes]:
    """(sender's frame key, receiver's frame key) of one transfer: fresh nonces give fresh keys."""
    salt = sender_nonce + receiver_nonce
    info = b"hearth-kv-v2 frames " + transfer_id.encode()
    return _hkdf(secret, salt, info + b" sender"), _hkdf(secret, salt, info + b" receiver")


class FrameMAC:
    """The tags of one direction of one transfer, in frame order (the sequence number is the nonce)."""

    def __init__(self, key: bytes) -> None:
        self._algorithm = algorithms.AES(key)
        self._sequence = 0

    def tag(self, header: bytes, payload: _BuffersLike = ()) -> bytes:
        """The next frame's tag over `header` and the `payload` buffers that follow it."""
        nonce = self._sequence.to_bytes(12, "big")
        self._sequence += 1
        context = Cipher(self._algorithm, modes.GCM(nonce)).encryptor()
        add = context.authenticate_additional_data  # once per page run: the lookup alone cost ~7%
        add(len(header).to_bytes(4, "big") + header)
        for part in payload:
            add(part)
        context.finalize()
        return context.tag

    def verify(self, tag: bytes, header: bytes, payload: _BuffersLike = ()) -> None:
        if not hmac.compare_digest(tag, self.tag(header, payload)):
            raise FrameAuthError("a frame failed its MAC: not sent by this transfer's authenticated peer")
