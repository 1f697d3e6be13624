"""afl wire protocol v1: .proto sources and checked-in generated code (docs/architecture.md §1)."""
