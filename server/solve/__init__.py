"""From released sums to the signed model and the pooled evaluation."""
