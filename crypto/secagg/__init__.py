"""Secure aggregation by pairwise masking (Bonawitz et al.; SecAgg+ sparse graphs)."""
