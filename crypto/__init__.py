"""Cryptographic primitives for secure aggregation (design §6); imports only numpy/cryptography.

Modules:
    errors       error classes (all derive from ``CryptoError``).
    canonical    injective, typed, length-prefixed encoding of field tuples; ``PROTOCOL_VERSION``.
    fixedpoint   fixed-point codec float64 <-> Z_{2^64} with a declared bound per block.
    prg          AES-256-CTR expansion of a full 32-byte seed into uint64 words.
    kdf          X25519 key agreement; HKDF-SHA256 with salt and domain-separated info.
    signatures   Ed25519 identity keys: sign/verify canonical messages, PEM/raw serialization.
    aead         AES-256-GCM for share payloads, bound to (sender, recipient, round).
    shamir       Shamir t-of-n sharing of 32-byte secrets over GF(2^521 - 1).
    masking      pairwise and self masks per release, and server-side unmasking helpers.
    pki          X.509 federation CA and site certificates for gRPC mutual TLS (design §9).
"""
