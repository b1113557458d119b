#!/usr/bin/env bash
# Unpack megatron-core (pure Python; its wheel, 2.6 MB) where the tests that compare with it import
# it from: $MEGATRON_CORE_DIR, default .venv/megatron_core.  It is not installed into the venv:
# only tests/megatron_core_harness.py puts it on sys.path.  No triton or Transformer Engine is needed
# (the harness builds Megatron-core's local layer spec).  Safe to run repeatedly.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${MEGATRON_CORE_VERSION:-0.16.1}"
DEST="${MEGATRON_CORE_DIR:-$root/.venv/megatron_core}"
PY="${PYTHON:-$root/.venv/bin/python}"
if [ -f "$DEST/megatron/core/__init__.py" ] && [ "$(cat "$DEST/.version" 2>/dev/null)" = "$VERSION" ]; then
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps "megatron-core==$VERSION" -d "$tmp" >"$tmp/log" 2>&1 || {
  cat "$tmp/log" >&2
  echo "fetch_megatron_core.sh: could not download megatron-core==$VERSION from the package index" >&2
  exit 1
}
rm -rf "$DEST.part"
mkdir -p "$DEST.part"
"$PY" -m zipfile -e "$tmp"/megatron_core-*.whl "$DEST.part"
echo "$VERSION" > "$DEST.part/.version"
rm -rf "$DEST"
mv "$DEST.part" "$DEST"
