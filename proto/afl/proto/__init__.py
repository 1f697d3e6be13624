"""afl wire protocol (generated gRPC/protobuf code lives in afl.proto.v1)."""
