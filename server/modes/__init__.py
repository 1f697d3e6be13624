"""The coordinator's aggregation modes behind one interface (plaintext, mask, ckks)."""
