"""The CKKS mode's cryptography: scheme, parameters, wire bindings, decryption."""
