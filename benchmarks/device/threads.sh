#!/usr/bin/env bash
# Threads reading one store on a lent many-core machine, with the GIL off: CPython 3.14t built
# there from the release tarball carried from here (the machine has Python 3.12 only and no
# network; `.ci/cpython 3.14t` builds it, ~1-2 minutes on 16 cores), then
# `benchmarks/bench_threads.py` with 1 to all cores' threads, the SharedList next to a plain
# list. From the repository root:
#
#     bash benchmarks/device/threads.sh OUTDIR
#
# Carry (the device tool's `carry`): target/cpython/python-3.14.4.tar.xz (23 MB, fetched here
# by `.ci/cpython 3.14t`) and WHEELS_T (default .whl314t/): shmstore's cp314t wheel
# (`maturin build --release -i target/cpython/3.14.4t/bin/python3.14t -o .whl314t`) and
# numpy's (`pip download numpy --only-binary :all: --python-version 3.14 --abi cp314t
# --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d
# .whl314t`, 16 MB). Writes
# OUTDIR/{machine.txt, threads.md, log.txt}. Changes no kernel or machine setting. THREADS
# (default: 1 2 4 8 and the core count), N (records, default 200000), ROUNDS (default 5),
# BENCH_TIMEOUT (default 240 s).
set -uo pipefail
. "$(dirname "$0")/common.sh"
start "${1:?usage: threads.sh OUTDIR}"

say "CPython 3.14t from the carried tarball"
if ! pyt=$(.ci/cpython 3.14t); then
    say "no 3.14t: the build failed (is target/cpython/python-3.14.4.tar.xz carried?)"
    exit 1
fi
venv=/tmp/venv-314t
rm -rf "$venv"
"$pyt" -m venv "$venv" || exit 1
"$venv/bin/python" -m pip install -q --no-index --no-cache-dir "${WHEELS_T:-.whl314t}"/*.whl || exit 1
py=$venv/bin/python
machine_facts | tee "$out/machine.txt"

threads=${THREADS:-"1 2 4 8 $cores"}
say "bench_threads: $threads threads"
# shellcheck disable=SC2086  # a list of thread counts
timeout "${BENCH_TIMEOUT:-240}" $py benchmarks/bench_threads.py --n "${N:-200000}" \
    --rounds "${ROUNDS:-5}" --threads $threads --out "$out/threads.md" \
    || say "bench_threads.py ended with $?"
say "done"
