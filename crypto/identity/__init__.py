"""Identity and signatures: X.509 PKI, Ed25519 keys, signed blobs, key custody, kit checks."""
