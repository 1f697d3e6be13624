"""`afl bench`: benchmark suites; each writes JSON recorded in docs/benchmarks.md."""
