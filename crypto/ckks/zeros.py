"""Encryptions of zero drawn ahead of the data they will carry (offline/online encryption,
docs/protocol.md §4.3).

SEAL's public-key CKKS encryption of a plaintext m is an encryption of zero under the public key
(u·pk + (e0, e1) at q0·p, switched down to q0) to whose first polynomial m is added
(``Encryptor::encrypt``: ``encrypt_zero`` then ``c0 += m``). The encryption of zero does not
depend on m and is about four fifths of the work (1.85 of 2.4 ms a ciphertext here, the rest
being the encoding and the serialization). A :class:`ZeroPool` draws those encryptions of zero
while a site is idle, so that when its statistics are ready each ciphertext costs one encoding
and one polynomial addition: c = Enc(0) + m, the same distribution as ``encrypt`` produces.

What keeps it as safe as encrypting on the spot:

- **Each encryption of zero is handed out once** (:meth:`ZeroPool.take` removes it under a
  lock): two ciphertexts sharing one would difference to m1 - m2.
- **Nothing leaves the process**: the pool lives in memory only, never on disk or on the wire.
  A daemon that stops loses it and draws anew.
- **One public key**: the pool is bound to the SHA-256 of the context it was drawn under (the
  announcement's ``context_sha256``, verified against the decryptor's signature by the caller),
  and hands out nothing for another context. An encryption of zero under another key would
  make a ciphertext the decryptor cannot decrypt.
- The randomness is SEAL's own (its default PRNG seeded from the OS), as for ``encrypt``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from afl.crypto.ckks import params as cp
from afl.crypto.ckks import scheme

__all__ = ["ZeroPool"]


class ZeroPool:
    """Fresh encryptions of zero under the public key of ``ctx`` (a verified public context whose
    serialized bytes have SHA-256 ``context_sha256``), at most ``capacity`` held at once, each
    handed out once."""

    def __init__(self, ctx: Any, *, context_sha256: bytes, capacity: int) -> None:
        scheme.check_parameters(ctx)
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.context_sha256 = bytes(context_sha256)
        self.capacity = int(capacity)
        self._seal = scheme._sealapi()
        self._seal_ctx = ctx.seal_context().data
        self._encryptor = self._seal.Encryptor(self._seal_ctx, ctx.public_key().data)
        self._ready: list[Any] = []
        self._lock = threading.Lock()
        self._drawing = threading.Lock()  # one drawer at a time (one Encryptor)
        self.drawn = 0  # encryptions of zero drawn so far
        self.taken = 0  # ... and handed out

    def __len__(self) -> int:
        with self._lock:
            return len(self._ready)

    def fill(self, count: int, *, keep_going: Callable[[], bool] = lambda: True) -> int:
        """Draw encryptions of zero until ``count`` (at most ``capacity``) are held, asking
        ``keep_going`` before each one (a pool that fills while a site is idle stops when its
        round needs the processor); the number drawn."""
        want, drawn = min(int(count), self.capacity), 0
        with self._drawing:
            while len(self) < want and keep_going():
                zero = self._seal.Ciphertext(self._seal_ctx)
                self._encryptor.encrypt_zero(zero)  # at the data level, NTT form, like encrypt
                zero.scale = cp.GLOBAL_SCALE  # what encrypt sets from the plaintext
                with self._lock:
                    self._ready.append(zero)
                    self.drawn += 1
                drawn += 1
        return drawn

    def take(self, context_sha256: bytes) -> Any | None:
        """One encryption of zero, removed from the pool (never handed out again); None when the
        pool is empty or was drawn under another context than ``context_sha256``."""
        if bytes(context_sha256) != self.context_sha256:
            return None
        with self._lock:
            if not self._ready:
                return None
            self.taken += 1
            return self._ready.pop()

    def clear(self) -> None:
        """Drop every encryption of zero held."""
        with self._lock:
            self._ready.clear()
