"""Release plans: what a round will release, signed before any upload, and its DP part."""
