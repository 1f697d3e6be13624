"""The federation log: RFC 9162 Merkle proofs, signed checkpoints and the witnesses' rule."""
