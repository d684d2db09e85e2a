#!/usr/bin/env bash
# A session's one call on a lent 16-core machine: the steps named in STEPS (default "probe
# reads ft ca"), in that order, within BUDGET seconds (default 480); a step that no longer
# fits in what is left is skipped and says so. Steps:
#
#   probe         benchmarks/probe_reads.py, this wheel and, when BASE_WHEELS names an
#                 earlier one's folder, that one alternating, ROUNDS rounds (default 2)
#   reads         the matrix's format and doc-store parts, idle then with busy loops on 1.5x
#                 the cores (BUSY)
#   format_again  the format part alone, idle then busy, AGAIN times (default 2): ranges
#   ft            the format part and bench_threads.py on a carried free-threaded 3.14t
#   ca            the Channel and arrays parts, idle then busy
#   arrays_busy   the arrays part with busy loops alone, ARRAYS_TIMEOUT s at most (240)
#   small         bench_segment_churn.py (segments and large arena objects put and closed
#                 in a loop: the supervisor's /proc scan grows with a machine's processes)
#                 and bench_threads.py --beside-busy (calls beside a thread running Python)
#   gpu           benchmarks/device/gpu_pin.py
#
# From the repository root, with shmstore's cp312 wheel and py-lmdb's in WHEELS (default
# .whl/):
#
#     PACK=$OUT/results.tgz bash benchmarks/device/session.sh OUTDIR
#
# PACK, when set, is rewritten (a tar.gz of OUTDIR) after every step, so that a call cut
# short still brings back what finished. 3.14t: PY314T_TAR, a tar.xz of an installed
# CPython 3.14t whose top folder is `3.14.4t` (`tar -cJf .py314t/py.tar.xz -C target/cpython
# 3.14.4t` after `.ci/cpython 3.14t`, tests and debug information left out; the interpreter
# is one static executable and finds its library next to it, wherever it is unpacked), and
# WHEELS_T (default .whl314t/) with shmstore's and numpy's cp314t wheels. Writes
# OUTDIR/{machine.txt, log.txt} and a markdown file per step run. Changes no kernel or
# machine setting. A trial run here: `MATRIX_SIZES=quick PROBE_N=20000 BUSY=2 bash ...
# /tmp/trial` (the matrix's smoke-test sizes).
set -uo pipefail
. "$(dirname "$0")/common.sh"
start "${1:?usage: session.sh OUTDIR}"
budget=${BUDGET:-480}
t0=$SECONDS

left() { echo $((budget - (SECONDS - t0))); }
pack() {
    [ -z "${PACK:-}" ] || { tar -czf "$PACK.part" -C "$out" . && mv "$PACK.part" "$PACK"; }
}
# step NAME SECONDS CMD...: run CMD (a command or an exported function), for at most what is
# left, when about SECONDS are left.
step() {
    local name=$1 need=$2
    shift 2
    if (($(left) < need)); then
        say "skipped: $name ($(left) s left, needs ~$need)"
        return
    fi
    say "$name"
    timeout "$(left)" bash -c '"$@"' step "$@" || say "$name ended with $?"
    pack
}
# One matrix run: matrix NAME PARTS BUSY [PYTHON] [PART_TIMEOUT].
matrix() {
    local name=$1 parts=$2 b=$3 mpy=${4:-$py} limit=${5:-$part_timeout}
    $mpy benchmarks/matrix.py "--${MATRIX_SIZES:-device}" --busy "$b" --label "device-$name" --only "$parts" \
        --part-timeout "$limit" --out "$out/$name.md"
}

export out py part_timeout MATRIX_SIZES
export -f matrix

install_wheels || exit 1
machine_facts | tee "$out/machine.txt"
pack
builds=(new)
if [ -n "${BASE_WHEELS:-}" ]; then
    install_wheels "$BASE_WHEELS" /tmp/site-base || exit 1
    builds+=(base)
fi

probe() {
    local round b site
    for round in $(seq 1 "${ROUNDS:-2}"); do
        for b in "${builds[@]}"; do
            site=/tmp/site
            [ "$b" = base ] && site=/tmp/site-base
            step "probe_reads: $b, round $round" 40 env PYTHONPATH="$site" $py \
                benchmarks/probe_reads.py --n "${PROBE_N:-200000}" --out "$out/probe-$b-$round.md"
        done
    done
}

reads() {
    step "matrix (format, docstore), idle" 100 matrix matrix-idle format,docstore 0
    step "matrix (format, docstore), $busy busy loops" 100 matrix "matrix-busy$busy" format,docstore "$busy"
}

# More runs of the format part alone, idle then busy in turn: the ranges a single run lacks.
format_again() {
    local k
    for k in $(seq 1 "${AGAIN:-2}"); do
        step "matrix (format), idle, again $k" 40 matrix "matrix-format-idle-$k" format 0
        step "matrix (format), $busy busy loops, again $k" 50 matrix "matrix-format-busy$busy-$k" format "$busy"
    done
}

# In a subshell without PYTHONPATH, which names the cp312 wheels' folder.
ft() {
    [ -n "${PY314T_TAR:-}" ] || { say "skipped: 3.14t (no PY314T_TAR)"; return; }
    (($(left) > 90)) || { say "skipped: 3.14t ($(left) s left)"; return; }
    (
        unset PYTHONPATH
        say "CPython 3.14t from $PY314T_TAR"
        mkdir -p /tmp/py314t && tar -xJf "$PY314T_TAR" -C /tmp/py314t
        venv=/tmp/venv-314t
        if /tmp/py314t/3.14.4t/bin/python3.14t -m venv "$venv" &&
            "$venv/bin/python" -m pip install -q --no-index --no-cache-dir "${WHEELS_T:-.whl314t}"/*.whl; then
            pyt=$venv/bin/python
            # shellcheck disable=SC2030,SC2031  # the facts for this interpreter only
            (py=$pyt machine_facts) | tee -a "$out/machine.txt"
            step "matrix (format), 3.14t idle" 60 matrix matrix-314t-idle format 0 "$pyt"
            # shellcheck disable=SC2086  # a list of thread counts
            step "bench_threads, 3.14t" 40 $pyt benchmarks/bench_threads.py --n "${N:-200000}" \
                --rounds "${THREAD_ROUNDS:-3}" --threads ${THREADS:-1 2 4 8 $cores} \
                --out "$out/threads-314t.md"
        else
            say "no 3.14t: its interpreter or wheels did not install"
        fi
    )
}

ca() {
    step "matrix (channel, arrays), idle" 80 matrix matrix-ca-idle channel,arrays 0
    step "matrix (channel, arrays), $busy busy loops" 80 matrix "matrix-ca-busy$busy" channel,arrays "$busy"
}

arrays_busy() {
    step "matrix (arrays), $busy busy loops" 120 matrix "matrix-arrays-busy$busy" arrays "$busy" \
        "$py" "${ARRAYS_TIMEOUT:-240}"
}

small() {
    step "bench_segment_churn" 40 $py benchmarks/bench_segment_churn.py --out "$out/segment-churn.md"
    step "bench_threads --beside-busy" 90 $py benchmarks/bench_threads.py --beside-busy \
        --out "$out/beside-busy.md"
}

gpu() {
    step "GPU pinning" 120 $py benchmarks/device/gpu_pin.py --out "$out/gpu-pin.md"
}

for s in ${STEPS:-probe reads ft ca}; do
    case $s in
    probe | reads | format_again | ft | ca | arrays_busy | small | gpu) "$s" ;;
    *) say "unknown step $s" ;;
    esac
done

echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
say "done in $((SECONDS - t0)) s"
pack
