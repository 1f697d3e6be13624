"""Composition layer: simulate, demo, bench, reports and the `afl` command line. Nothing imports it."""
