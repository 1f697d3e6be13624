"""The statements the federation log holds, as the bytes its leaves hash (docs/protocol.md §11a).

A statement is a kind and a JSON object of fields; its leaf entry is the canonical encoding
(:func:`afl.crypto.canonical.canonical_encode`) of

    ("afl-log-statement/1", federation, kind, JSON text with sorted keys and no spaces)

so a statement of one federation never verifies in another's log and no two (kind, fields)
pairs share bytes. Parties that must recognise a statement rebuild it from what they hold (a
site: the plan it verified, :func:`plan_statement`) and look for its leaf hash in the log.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from afl.crypto.canonical import canonical_encode
from afl.crypto.errors import CryptoError

__all__ = [
    "DECRYPTING_CONTEXT",
    "DP_RELEASE_CONTEXT",
    "KINDS",
    "OPENING_CONTEXT",
    "OPENING_MODES",
    "STATEMENT_TAG",
    "StatementError",
    "decode_statement",
    "decrypting_signed_fields",
    "decrypting_statement",
    "dp_release_signed_fields",
    "dp_release_statement",
    "opened_release_statement",
    "opening_signed_fields",
    "opening_statement",
    "plan_statement",
    "release_sha256",
    "roster_digest",
    "roster_fields",
    "roster_statement",
    "statement_bytes",
]

STATEMENT_TAG = "afl-log-statement/1"
ROSTER_TAG = "afl-roster/1"

#: Every kind of statement the coordinator appends (docs/protocol.md §11a).
KINDS = (
    "enrolment",  # a site's identity key, role and declared features (a new key: a rotation)
    "run-submitted",
    "run-ended",  # published, aborted (by an admin, or a failure) or failed
    "plan",  # every signed release plan, training and evaluation
    "release",  # a round's sums were released: the survivors they were unmasked over, digests
    "round-aborted",
    "roster",  # the provisioned roster: every site's identity key, and its digest (M-220)
    "dp-release",  # a site's ledger entry for a plan it uploads under, signed by the site
    "opening",  # a site helps unmask a round's sums (its release's digest), signed by the site
    "opened-release",  # the release an opening signs the digest of: once per round (M-232)
    "decrypting",  # the CKKS decryptor decrypts a round's sums, signed before it does (M-235)
)


class StatementError(CryptoError):
    """A log entry is not a statement of this federation."""


def _json(fields: Mapping[str, object]) -> str:
    return json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))


def statement_bytes(*, federation: str, kind: str, fields: Mapping[str, object]) -> bytes:
    """The leaf entry of statement ``kind`` with ``fields`` in ``federation``'s log."""
    if kind not in KINDS:
        raise StatementError(f"unknown log statement kind {kind!r}")
    return canonical_encode((STATEMENT_TAG, federation, kind, _json(fields)))


def plan_statement(*, federation: str, round_id: str, plan_sha256: bytes) -> bytes:
    """The entry the coordinator appends for the signed release plan of ``round_id`` (the SHA-256
    of the plan bytes), rebuilt by each site from the plan it verified."""
    return statement_bytes(
        federation=federation,
        kind="plan",
        fields={"round_id": round_id, "plan_sha256": plan_sha256.hex()},
    )


#: The signature context of a site's DP-release statement (docs/protocol.md §11a, M-195).
DP_RELEASE_CONTEXT = "dp-release"


def dp_release_signed_fields(
    *, federation: str, site: str, entry: Mapping[str, object]
) -> tuple[str, str, str]:
    """What a site signs (context :data:`DP_RELEASE_CONTEXT`) for its ledger entry ``entry``
    (the entry's JSON object, chain digest included): (federation, site, JSON of the entry with
    sorted keys). Its statement (:func:`dp_release_statement`) carries the entry and the
    signature, so the coordinator can neither forge nor alter one, and a site that lost its
    ledger rebuilds it, byte for byte, from its own signed statements."""
    return (federation, site, _json(entry))


def dp_release_statement(
    *, federation: str, site: str, entry: Mapping[str, object], signature: bytes
) -> bytes:
    """The `dp-release` entry: fields {site, entry, signature (hex)}."""
    return statement_bytes(
        federation=federation,
        kind="dp-release",
        fields={"site": site, "entry": dict(entry), "signature": signature.hex()},
    )


#: The signature context of a site's opening statement (docs/protocol.md §11a, M-232).
OPENING_CONTEXT = "opening"


#: The aggregation modes an opening is signed in: what its release's sum holds differs.
OPENING_MODES = ("mask", "ckks")


def release_sha256(release: Mapping[str, object]) -> bytes:
    """SHA-256 of a release's fields (the `release` statement's form: round, run, survivors,
    every planned release) as JSON with sorted keys and no spaces: what an opening signs."""
    return hashlib.sha256(_json(release).encode("utf-8")).digest()


def opening_signed_fields(
    *,
    federation: str,
    site: str,
    round_id: str,
    plan_sha256: bytes,
    mode: str,
    release_sha256: bytes,
) -> tuple[str, str, str, str, str, str]:
    """What a site signs (context :data:`OPENING_CONTEXT`) before it sends the unmask shares
    of a masked round, or its first ciphertext of a CKKS round: (federation, site, round id,
    SHA-256 of the signed plan in hex, the round's aggregation ``mode``
    (:data:`OPENING_MODES`), the :func:`release_sha256` of the round's release as the site
    knows it (round, run, the survivors, every planned release), in hex). The release itself
    is logged once per round, as an `opened-release` statement
    (:func:`opened_release_statement`), so a round's openings add O(K) bytes to the log, not
    O(K²). Logged before any of it leaves, so every site's whole-history audit counts the
    release whatever the coordinator states of it."""
    return (federation, site, round_id, plan_sha256.hex(), mode, release_sha256.hex())


def opening_statement(
    *,
    federation: str,
    site: str,
    round_id: str,
    plan_sha256: bytes,
    mode: str,
    release_sha256: bytes,
    signature: bytes,
) -> bytes:
    """The `opening` entry: fields {site, round_id, plan_sha256 (hex), mode, release_sha256
    (hex), signature (hex)}."""
    return statement_bytes(
        federation=federation,
        kind="opening",
        fields={
            "site": site,
            "round_id": round_id,
            "plan_sha256": plan_sha256.hex(),
            "mode": mode,
            "release_sha256": release_sha256.hex(),
            "signature": signature.hex(),
        },
    )


def opened_release_statement(*, federation: str, release: Mapping[str, object]) -> bytes:
    """The `opened-release` entry: the release's fields themselves (whose
    :func:`release_sha256` an opening signs). Every party that knows the release builds the
    same bytes, so the log holds it once however many sites open the round; it is nobody's
    word on its own (an opening gives it weight, by its digest)."""
    return statement_bytes(federation=federation, kind="opened-release", fields=release)


#: The signature context of the CKKS decryptor's `decrypting` statement (docs/protocol.md §11a,
#: M-235); distinct from the context of its per-release decryption outcomes.
DECRYPTING_CONTEXT = "decrypting"


def decrypting_signed_fields(
    *, federation: str, decryptor: str, round_id: str, plan_sha256: bytes
) -> tuple[str, str, str, str]:
    """What the decryptor signs (context :data:`DECRYPTING_CONTEXT`) before it decrypts any
    sum of a CKKS round: (federation, decryptor, round id, SHA-256 of the signed plan in hex).
    Logged, in a quorum-cosigned checkpoint, before the first decryption: a round without one
    was never decrypted, and once the log records the round as aborted before the statement,
    an honest decryptor never decrypts it."""
    return (federation, decryptor, round_id, plan_sha256.hex())


def decrypting_statement(
    *, federation: str, decryptor: str, round_id: str, plan_sha256: bytes, signature: bytes
) -> bytes:
    """The `decrypting` entry: fields {site (the decryptor), round_id, plan_sha256 (hex),
    signature (hex)}."""
    return statement_bytes(
        federation=federation,
        kind="decrypting",
        fields={
            "site": decryptor,
            "round_id": round_id,
            "plan_sha256": plan_sha256.hex(),
            "signature": signature.hex(),
        },
    )


def roster_digest(*, federation: str, keys: Mapping[str, bytes]) -> bytes:
    """SHA-256 of the canonical encoding of ("afl-roster/1", federation, then each site id and
    its raw identity public key, sites sorted): what a plan binds and a site recomputes from its
    kit's ``[peers]`` (and its own key)."""
    fields: list[str | bytes] = [ROSTER_TAG, federation]
    for site in sorted(keys):
        fields += [site, bytes(keys[site])]
    return hashlib.sha256(canonical_encode(tuple(fields))).digest()


def roster_fields(*, federation: str, keys: Mapping[str, bytes]) -> dict[str, object]:
    """The fields of the roster statement: its digest and every site's identity key (hex)."""
    return {
        "roster_sha256": roster_digest(federation=federation, keys=keys).hex(),
        "sites": {s: bytes(k).hex() for s, k in sorted(keys.items())},
    }


def roster_statement(*, federation: str, keys: Mapping[str, bytes]) -> bytes:
    """The entry the coordinator appends for its roster (at start-up, when it changed)."""
    return statement_bytes(
        federation=federation, kind="roster", fields=roster_fields(federation=federation, keys=keys)
    )


def decode_statement(entry: bytes, *, federation: str) -> tuple[str, dict[str, object]]:
    """(kind, fields) of a leaf entry, which must be this federation's statement."""
    try:
        fields = _decode_fields(entry)
        tag, fed, kind, text = fields
        if not all(isinstance(f, str) for f in fields):
            raise ValueError("fields are not strings")
        detail = json.loads(str(text))
    except (ValueError, TypeError) as exc:
        raise StatementError(f"log entry is not a statement ({exc})") from exc
    if tag != STATEMENT_TAG or fed != federation:
        raise StatementError(f"log entry is a statement of {fed!r}, not of {federation!r}")
    if kind not in KINDS or not isinstance(detail, dict):
        raise StatementError(f"log entry of unknown kind {kind!r}")
    if statement_bytes(federation=federation, kind=str(kind), fields=detail) != entry:
        raise StatementError("log entry is not in canonical form")
    return str(kind), detail


def _decode_fields(data: bytes) -> list[bytes | str]:
    """Inverse of canonical_encode for bytes and str fields (ValueError otherwise)."""
    if len(data) < 4:
        raise ValueError("too short")
    count, pos = int.from_bytes(data[:4], "big"), 4
    out: list[bytes | str] = []
    for _ in range(count):
        if pos + 9 > len(data):
            raise ValueError("truncated")
        tag, length = data[pos : pos + 1], int.from_bytes(data[pos + 1 : pos + 9], "big")
        payload = data[pos + 9 : pos + 9 + length]
        if len(payload) != length:
            raise ValueError("truncated")
        pos += 9 + length
        if tag == b"S":
            out.append(payload.decode("utf-8"))
        elif tag == b"B":
            out.append(payload)
        else:
            raise ValueError(f"field tag {tag!r}")
    if pos != len(data):
        raise ValueError("trailing bytes")
    return out
