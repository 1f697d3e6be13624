"""The paper's method as exact float64 math: labels, statistics, aggregation, metrics, data protocol."""
