"""`afl simulate`: the paper's experiment grid in process, baselines and DP rows."""
