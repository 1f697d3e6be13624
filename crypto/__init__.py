"""Cryptographic primitives for secure aggregation (docs/protocol.md §4.2, §4.3, §5); imports only
numpy, cryptography and tenseal (the CKKS modules).

Modules:
    errors       error classes (all derive from ``CryptoError``).
    canonical    injective, typed, length-prefixed encoding of field tuples; ``DOMAIN_TAG``.
    fixedpoint   fixed-point codec float64 <-> Z_{2^64} with a declared bound per block.
    prg          AES-256-CTR expansion of a full 32-byte seed into uint64 words.
    kdf          X25519 key agreement; HKDF-SHA256 with salt and domain-separated info.
    signatures   Ed25519 identity keys: sign/verify canonical messages, PEM/raw serialization.
    aead         AES-256-GCM for share payloads, bound to (sender, recipient, round).
    shamir       Shamir t-of-n sharing of 32-byte secrets over GF(2^521 - 1).
    masking      pairwise and self masks per release, and server-side unmasking helpers.
    secagg_config    round config: cohort, threshold t, round id/salt, release plan and codecs.
    secagg_messages  frozen dataclasses of every protocol message; signed payload fields.
    secagg_client    client state machine of the Bonawitz et al. protocol (with Unmask refusals).
    secagg_server    server state machine: stage checks, drop-outs, release rule, result.
    secagg_unmask    server-side reconstruction of dropped mask keys and self masks.
    secagg_local     in-process driver of one round with drop-outs, timing and byte counts.
    pki          X.509 federation CA and site certificates for gRPC mTLS (docs/protocol.md §3).
    ckks_params  vetted CKKS parameters (N, moduli, scale, security), pre-scaling and noise bounds.
    ckks         CKKS contexts (public/private), tagged block encryption, (de)serialization, sums.
    ckks_decrypt decryptor: tag-checked, grid-rounded, decrypt-once (docs/protocol.md §4.3).
"""
