#!/usr/bin/env bash
# Runs every fuzz target of the module for a short time each (default 10s).
# Usage: scripts/fuzz.sh [FUZZTIME]
set -euo pipefail
cd "$(dirname "$0")/.."
fuzztime=${1:-10s}
found=0
for pkg in $(go list ./...); do
  for target in $(go test -list '^Fuzz' "$pkg" 2>/dev/null | grep '^Fuzz' || true); do
    found=$((found + 1))
    echo "== $pkg $target ($fuzztime)"
    go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$pkg"
  done
done
if [ "$found" -eq 0 ]; then
  echo "no fuzz targets found" >&2
  exit 1
fi
echo "fuzzed $found targets for $fuzztime each"
