#!/usr/bin/env bash
# The Channel rows of the benchmark matrix (idle, then busy loops on 1.5x the cores), then the
# fault campaign (benchmarks/soak.py) on a lent 16-core machine: more workers at once than the
# 2-core VM can run, so more of them meet each other inside a put, a get or a sweep. From the
# repository root, with shmstore's wheel in WHEELS (default .whl/):
#
#     bash benchmarks/device/soak.sh OUTDIR
#
# Writes OUTDIR/{machine.txt, channel-idle.md, channel-busy<N>.md, soak.md, log.txt}. As root
# the campaign mounts its tiny tmpfs inside its own private directory and plants a state
# directory there; nothing changes a kernel or machine setting. SOAK_WORKERS (default: the
# cores), SOAK_FAULTS (default 50000), SOAK_SECONDS (default 240), SOAK_INTERVAL (default
# 0.004 s between faults), PART_TIMEOUT (default 60 s per Channel run), CHANNEL=0 to skip the
# Channel rows.
set -uo pipefail
. "$(dirname "$0")/common.sh"
start "${1:?usage: soak.sh OUTDIR}"

install_wheels || exit 1
machine_facts | tee "$out/machine.txt"

[ "${CHANNEL:-1}" = 0 ] || matrix_idle_busy channel channel

say "fault campaign"
secs=${SOAK_SECONDS:-240}
timeout $(( secs + 150 )) $py benchmarks/soak.py --seed 11 --workers "${SOAK_WORKERS:-$cores}" \
    --faults "${SOAK_FAULTS:-50000}" --seconds "$secs" --settle 30 --interval "${SOAK_INTERVAL:-0.004}" \
    --out "$out/soak.md" >/dev/null
say "soak.py ended with $?"
echo "load after the campaign: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
say "done"
