#!/usr/bin/env bash
# The benchmark matrix on a 16-core machine with Python 3.12 (numpy, psutil, pyarrow, torch
# preinstalled; no network; shmstore's wheel installed beforehand; py-lmdb may be missing, then
# the doc store's lmdb baseline is skipped). Runs the matrix idle, then with 24 busy loops
# (1.5x the cores), each with sizes that keep the whole under ~6 minutes, and writes markdown
# under the directory given as $1:
#
#     bash benchmarks/device/matrix.sh OUTDIR        (from the repository root)
#
# PYTHON (default python3) picks the interpreter; BUSY (default 24) the busy loops of the
# second run; PART_TIMEOUT (default 100) bounds each part of each run in seconds.
set -euo pipefail
out=${1:?usage: matrix.sh OUTDIR}
py=${PYTHON:-python3}
busy=${BUSY:-24}
part_timeout=${PART_TIMEOUT:-100}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
stamp() { date +%H:%M:%S; }
echo "[$(stamp)] $($py --version) on $(nproc) cores; shmstore: $($py -c 'import shmstore; print(shmstore.__file__)')"
# Fail early (and say why) if a fast path this build should have is off.
SHMSTORE_REQUIRE_FAST_PATHS=1 $py -c 'import shmstore._native as n; print(n._fast_paths())' \
    || echo "[$(stamp)] WARNING: a fast path is off (see above); measuring anyway"
start=$(date +%s)
echo "[$(stamp)] idle run"
$py "$here/matrix.py" --device --busy 0 --label idle --part-timeout "$part_timeout" \
    --out "$out/matrix-idle.md"
echo "[$(stamp)] busy run ($busy busy loops)"
$py "$here/matrix.py" --device --busy "$busy" --label "busy$busy" --part-timeout "$part_timeout" \
    --out "$out/matrix-busy$busy.md"
echo "[$(stamp)] done in $(( $(date +%s) - start )) s: $out/matrix-idle.md $out/matrix-busy$busy.md"
