#!/usr/bin/env bash
# The fault campaign (benchmarks/soak.py) on a lent 16-core machine: more workers at once than
# the 2-core VM can run, so more of them meet each other inside a put, a get or a sweep. Then
# the read probe (benchmarks/probe_reads.py) for the record of that machine's read costs. From
# the repository root, with shmstore's wheel in WHEELS (default .whl/):
#
#     bash benchmarks/device/soak.sh OUTDIR
#
# Writes OUTDIR/{machine.txt, soak.md, probe-reads.md, log.txt}. As root the campaign mounts its
# tiny tmpfs inside its own private directory and plants a state directory there; it changes no
# kernel or machine setting. SOAK_WORKERS (default: the cores), SOAK_FAULTS (default 60000),
# SOAK_SECONDS (default 330), PROBE_TIMEOUT (default 120 s).
set -uo pipefail
out=${1:?usage: soak.sh OUTDIR}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
cores=$(nproc)
stamp() { date +%H:%M:%S; }
say() { echo "[$(stamp)] $*"; }

if ls "$wheels"/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
    echo "date: $(date -u +%FT%TZ)"
    echo "cores: $cores; $(grep -m1 'model name' /proc/cpuinfo)"
    echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "python: $($py --version 2>&1)"
    echo "user: $(id -un) (uid $(id -u))"
    $py -c 'import shmstore; print("shmstore", shmstore.__version__, shmstore.__file__)'
} | tee "$out/machine.txt"

say "fault campaign"
secs=${SOAK_SECONDS:-330}
timeout $(( secs + 200 )) $py benchmarks/soak.py --seed 11 --workers "${SOAK_WORKERS:-$cores}" \
    --faults "${SOAK_FAULTS:-60000}" --seconds "$secs" --settle 30 --interval 0.004 \
    --out "$out/soak.md" >/dev/null
say "soak.py ended with $?"
echo "load after the campaign: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"

say "read probe"
timeout "${PROBE_TIMEOUT:-120}" $py benchmarks/probe_reads.py --out "$out/probe-reads.md" \
    || say "probe_reads.py ended with $?"
say "done"
