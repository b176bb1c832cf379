#!/usr/bin/env bash
# Vendor uPlot (the web view's charts) into api/web/static/vendor/ from the npm registry, with its
# license. The files are committed: Apiary serves them itself (no CDN at run time, works offline).
# Run again only to change the pinned version:
#   bash scripts/vendor_uplot.sh
set -euo pipefail
VERSION=1.6.32
cd "$(dirname "$0")/.."
dest=api/web/static/vendor
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@${VERSION}" >/dev/null && tar -xzf "uplot-${VERSION}.tgz")
mkdir -p "$dest"
cp "$work/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
cp "$work/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
cp "$work/package/LICENSE" "$dest/uPlot.LICENSE"
echo "uPlot ${VERSION} -> ${dest}"
