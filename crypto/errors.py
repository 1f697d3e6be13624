"""Error types of afl.crypto, under one base class so callers map them in one place.

Messages never include secret material (keys, seeds, shares) or statistics.
"""

from __future__ import annotations

__all__ = [
    "CkksAlreadyDecryptedError",
    "CkksConfigError",
    "CkksContextError",
    "CkksError",
    "CkksMalformedError",
    "CkksNotInPlanError",
    "CkksRangeError",
    "CkksTagMismatchError",
    "CryptoError",
    "DecryptionError",
    "DuplicateMessageError",
    "EncodingRangeError",
    "FixedPointConfigError",
    "InvalidSeedError",
    "KeyAgreementError",
    "KeyFormatError",
    "MaskingError",
    "ProtocolError",
    "RoundAbortedError",
    "RoundMismatchError",
    "SecAggConfigError",
    "ShamirError",
    "SignatureError",
    "StageError",
    "UnknownParticipantError",
    "UnmaskRefusedError",
]


class CryptoError(Exception):
    """Base class of every error raised by afl.crypto."""


class FixedPointConfigError(CryptoError, ValueError):
    """A fixed-point codec whose bound, fractional bits and summand count overflow Z_{2^64}."""


class EncodingRangeError(CryptoError, ValueError):
    """An input value is outside the codec's declared bound, or is NaN/inf (never clipped)."""


class InvalidSeedError(CryptoError, ValueError):
    """A PRG seed or symmetric key is not of the required type and exact length."""


class KeyAgreementError(CryptoError, ValueError):
    """X25519 agreement failed (malformed or low-order public key) or bad KDF inputs."""


class KeyFormatError(CryptoError, ValueError):
    """Serialized key material could not be loaded, or is of the wrong key type."""


class SignatureError(CryptoError):
    """An Ed25519 signature does not verify for the given public key and message."""


class DecryptionError(CryptoError):
    """AES-GCM authentication failed: wrong key, tampered ciphertext or mismatched binding."""


class ShamirError(CryptoError, ValueError):
    """Invalid Shamir parameters, shares or reconstruction (too few, duplicates, inconsistent)."""


class MaskingError(CryptoError, ValueError):
    """Inconsistent inputs to the pairwise/self masking helpers (members, seeds, lengths)."""


class ProtocolError(CryptoError):
    """A secure-aggregation protocol violation (docs/protocol.md §4.2): wrong stage, unknown or
    dropped sender, duplicate message, message for another round, or an invalid message body."""


class StageError(ProtocolError):
    """A message (or a call) that belongs to another stage of the protocol state machine."""


class UnknownParticipantError(ProtocolError):
    """A message from a site outside the cohort, or from one that dropped out at an earlier stage."""


class DuplicateMessageError(ProtocolError):
    """A second message from the same site in the same stage."""


class RoundMismatchError(ProtocolError):
    """A message whose round id is not the round this state machine runs."""


class UnmaskRefusedError(ProtocolError):
    """A client refuses an Unmask request: it would reveal both shares of one peer, or it is
    inconsistent with the survivor list the client signed in ConsistencyCheck."""


class RoundAbortedError(ProtocolError):
    """The round was aborted (e.g. fewer than t live clients); nothing is released."""


class SecAggConfigError(ProtocolError, ValueError):
    """An invalid round configuration (cohort, threshold, releases)."""


class CkksError(CryptoError):
    """Base class of the CKKS mode's errors (docs/protocol.md §4.3)."""


class CkksConfigError(CkksError, ValueError):
    """Invalid CKKS parameters: bound, summand count, pre-scale, grid, length or release spec."""


class CkksContextError(CkksError):
    """A CKKS context of the wrong kind: a private context where only a public one is allowed
    (a server holding the secret key must refuse to start), a public one where the secret key is
    needed, parameters other than the vetted ones, or bytes that are not a context."""


class CkksRangeError(CkksError, ValueError):
    """A value (or tag) outside the declared bound after pre-scaling, or NaN/inf (never clipped)."""


class CkksMalformedError(CkksError, ValueError):
    """Ciphertext bytes that do not parse, or ciphertexts of the wrong count, size, scale or level."""


class CkksNotInPlanError(CkksError):
    """A decryption request for a release not in the signed plan, or with other members."""


class CkksAlreadyDecryptedError(CkksError):
    """A second decryption request for a release (each release is decrypted at most once)."""


class CkksTagMismatchError(CkksError):
    """The tag slot of a 'sum' does not equal the sum of the members' secret tags: the server did
    not sum exactly the plan's members (e.g. forwarded a single site's ciphertext)."""
