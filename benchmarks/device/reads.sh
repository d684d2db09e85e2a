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
out=${1:?usage: reads.sh OUTDIR}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
cores=$(nproc)
busy=${BUSY:-$(( cores * 3 / 2 ))}
part_timeout=${PART_TIMEOUT:-60}
. "$(dirname "$0")/common.sh"

install_wheels || exit 1
machine_facts | tee "$out/machine.txt"
builds=(new)
if [ -n "${BASE_WHEELS:-}" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-base "$BASE_WHEELS"/*.whl || exit 1
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

for b in 0 "$busy"; do
    name=$([ "$b" = 0 ] && echo idle || echo "busy$b")
    say "matrix reads, $name"
    timeout $(( part_timeout + 30 )) $py benchmarks/matrix.py --device --busy "$b" \
        --label "device-reads-$name" --only format --part-timeout "$part_timeout" \
        --out "$out/matrix-reads-$name.md" || say "matrix $name ended with $?"
done
say "done"
