#!/usr/bin/env bash
# Fails (exit 1) when the checked-in generated code in proto/afl/proto/v1 differs from what
# scripts/gen_proto.sh produces from the .proto sources now (docs/architecture.md §1). Called by
# `make test`. The generator versions are pinned in scripts/gen_proto.sh (exit 2 if they are not
# installed).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

scripts/gen_proto.sh "$tmp" >/dev/null 2>&1 || { scripts/gen_proto.sh "$tmp"; exit 2; }

status=0
generated_patterns=("*_pb2.py" "*_pb2.pyi" "*_pb2_grpc.py" "*_pb2_grpc.pyi")
for pattern in "${generated_patterns[@]}"; do
  # Files that should exist (freshly generated) must match the checked-in ones ...
  for fresh in "$tmp"/afl/proto/v1/$pattern; do
    [[ -e "$fresh" ]] || continue
    name="$(basename "$fresh")"
    if ! diff -u "proto/afl/proto/v1/$name" "$fresh" >"$tmp/diff.txt" 2>&1; then
      echo "proto drift: proto/afl/proto/v1/$name is stale; run scripts/gen_proto.sh" >&2
      head -40 "$tmp/diff.txt" >&2
      status=1
    fi
  done
  # ... and no stale generated file may remain for a .proto that no longer exists.
  for kept in proto/afl/proto/v1/$pattern; do
    [[ -e "$kept" ]] || continue
    if [[ ! -e "$tmp/afl/proto/v1/$(basename "$kept")" ]]; then
      echo "proto drift: $kept has no .proto source any more; delete it" >&2
      status=1
    fi
  done
done

if [[ $status -eq 0 ]]; then echo "proto: generated code is up to date"; fi
exit $status
