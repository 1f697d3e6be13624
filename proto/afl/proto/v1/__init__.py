"""afl wire protocol, version 1: .proto sources and checked-in generated code (design §2)."""
