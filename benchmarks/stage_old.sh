#!/usr/bin/env bash
# Unpacks the stacked-layout code (main at 257fc3f, before the per-layer refactor) into .old/ for the device
# script's layout_old stage, which compares it with the current layout in the same command. Run it here, from
# the repository root, then carry .old (run's `carry`); .old/ is listed in .git/info/exclude, never committed.
set -euo pipefail
REV=${1:-257fc3f}
rm -rf .old && mkdir -p .old
git archive "$REV" kvjax benchmarks | tar -x -C .old
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.old/' "$exclude" 2>/dev/null || echo '/.old/' >> "$exclude"
du -sh .old
