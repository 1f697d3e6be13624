"""Evaluation statistics: federated releases, a site's local evaluation, calibration, score bins."""
