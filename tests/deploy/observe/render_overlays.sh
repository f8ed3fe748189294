#!/usr/bin/env bash
# Renders each kustomize overlay with `kubectl kustomize` into OUTDIR/NAME.yaml
# (NAME: the overlay folder's name). Fails naming the overlay that does not
# render.
#
#   tests/deploy/observe/render_overlays.sh OUTDIR OVERLAY_DIR...
# Exits 77 (ctest's skip) when kubectl is missing.
set -euo pipefail

out=${1:?usage: $0 OUTDIR OVERLAY_DIR...}
shift
if ! command -v kubectl >/dev/null 2>&1; then
  echo "SKIP: kubectl is not installed (it renders the kustomize overlays)" >&2
  exit 77
fi
mkdir -p "$out"
status=0
for overlay in "$@"; do
  name=$(basename "$overlay")
  if kubectl kustomize "$overlay" >"$out/$name.yaml.tmp" 2>"$out/$name.err"; then
    mv "$out/$name.yaml.tmp" "$out/$name.yaml"
    echo "rendered $overlay: $(grep -c '^kind:' "$out/$name.yaml") objects -> $out/$name.yaml"
  else
    echo "FAIL: $overlay: kubectl kustomize cannot render it: $(cat "$out/$name.err")" >&2
    rm -f "$out/$name.yaml" "$out/$name.yaml.tmp"
    status=1
  fi
done
exit "$status"
