"""What a site uploads for a release: statistics, DP shares, evaluation counts."""
