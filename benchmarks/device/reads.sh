#!/usr/bin/env bash
# The read targets on a lent machine, in ~4 minutes: `benchmarks/probe_reads.py` (each read
# timed beside the interpreter's own) for this source's wheel and, when BASE_WHEELS names a
# directory with an earlier wheel, for that one too, alternating, three rounds each (that
# machine's speed moves between calls minutes apart: only a paired run compares two builds);
# then the matrix's read part idle and with busy loops on 1.5x the cores. From the repository
# root, with shmstore's wheel in WHEELS (default .whl/):
#
#     bash benchmarks/device/reads.sh OUTDIR
#
# Writes OUTDIR/{machine.txt, probe-<build>-<round>.md, matrix-reads-idle.md,
# matrix-reads-busy<N>.md, log.txt}. Changes no kernel or machine setting. ROUNDS (default 3),
# PROBE_N (default 200000), PART_TIMEOUT (default 60 s per matrix run).
set -uo pipefail
. "$(dirname "$0")/common.sh"
start "${1:?usage: reads.sh OUTDIR}"

install_wheels || exit 1
machine_facts | tee "$out/machine.txt"
builds=(new)
if [ -n "${BASE_WHEELS:-}" ]; then
    install_wheels "$BASE_WHEELS" /tmp/site-base || exit 1
    builds+=(base)
fi

for round in $(seq 1 "${ROUNDS:-3}"); do
    for b in "${builds[@]}"; do
        site=/tmp/site
        [ "$b" = base ] && site=/tmp/site-base
        say "probe_reads: $b, round $round"
        PYTHONPATH=$site timeout 120 $py benchmarks/probe_reads.py --n "${PROBE_N:-200000}" \
            --out "$out/probe-$b-$round.md" || say "probe_reads ended with $?"
    done
done

matrix_idle_busy format matrix-reads
say "done"
