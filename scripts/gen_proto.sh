#!/usr/bin/env bash
# Regenerates the checked-in Python code for proto/afl/proto/v1/*.proto (docs/architecture.md §1).
#
# Usage: scripts/gen_proto.sh [OUT_ROOT]
#   OUT_ROOT defaults to proto/ (in place). scripts/check_proto_drift.sh passes a temp dir.
#   PYTHON (default .venv/bin/python, else python3) selects the interpreter with the tools.
#
# Generated with (pinned; regenerate with exactly these versions, or the drift check fails):
#   grpcio-tools  1.85.1   (bundled protoc: libprotoc 35.1 -> protobuf Python gencode 7.35.1)
#   mypy-protobuf 5.1.0    (protoc-gen-mypy, protoc-gen-mypy_grpc)
# Runtime lower bounds implied by the generated code (it checks them at import):
#   protobuf >= 7.35.1 (< 8), grpcio >= 1.85.1 (the *_pb2_grpc.py version check),
#   types-protobuf for type checking the .pyi stubs.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

out_root="${1:-proto}"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
python="$(command -v "$python")"
case "$python" in /*) ;; *) python="$repo_root/$python" ;; esac
bin_dir="$(dirname "$python")"

want_tools="1.85.1"
want_mypy_protobuf="5.1.0"
have_tools="$("$python" -c 'import importlib.metadata as m; print(m.version("grpcio-tools"))')"
have_mypy_protobuf="$("$python" -c 'import importlib.metadata as m; print(m.version("mypy-protobuf"))')"
if [[ "$have_tools" != "$want_tools" || "$have_mypy_protobuf" != "$want_mypy_protobuf" ]]; then
  echo "gen_proto: need grpcio-tools==$want_tools and mypy-protobuf==$want_mypy_protobuf," \
       "found $have_tools and $have_mypy_protobuf" >&2
  exit 2
fi

mkdir -p "$out_root/afl/proto/v1"
out_abs="$(realpath "$out_root")"
# Sorted for a stable order; paths relative to -I proto so imports read `from afl.proto.v1 import`.
mapfile -t protos < <(cd proto && LC_ALL=C ls afl/proto/v1/*.proto)
(
  cd proto
  "$python" -m grpc_tools.protoc -I . \
    --plugin=protoc-gen-mypy="$bin_dir/protoc-gen-mypy" \
    --plugin=protoc-gen-mypy_grpc="$bin_dir/protoc-gen-mypy_grpc" \
    --python_out="$out_abs" \
    --grpc_python_out="$out_abs" \
    --mypy_out="$out_abs" \
    --mypy_grpc_out="$out_abs" \
    "${protos[@]}"
)
echo "gen_proto: generated ${#protos[@]} file(s) into $out_root/afl/proto/v1"
