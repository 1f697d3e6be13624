"""The DP rulebook: privacy accounting, noise calibration and DP releases of the statistics."""
