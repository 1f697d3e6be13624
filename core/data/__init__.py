"""The data protocol: NIH metadata, surrogate features, class assignment, the feature cache."""
