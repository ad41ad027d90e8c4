#!/usr/bin/env bash
# Unpacks an older kvjax (its kvjax/ and benchmarks/) into a folder of the repository for a device stage that
# compares it with the current code in the same command. Run it here, from the repository root, then carry the
# folder (run's `carry`); the folder is listed in .git/info/exclude, never committed.
#
#   bash benchmarks/stage_old.sh                      # 257fc3f into .old/: the stacked layout (layout_old)
#   bash benchmarks/stage_old.sh b00e9b7 .old57       # main before issue 57 (bars_old: the "today" of its bars)
set -euo pipefail
REV=${1:-257fc3f}
DIR=${2:-.old}
rm -rf "$DIR" && mkdir -p "$DIR"
git archive "$REV" kvjax benchmarks | tar -x -C "$DIR"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx "/$DIR/" "$exclude" 2>/dev/null || echo "/$DIR/" >> "$exclude"
du -sh "$DIR"
