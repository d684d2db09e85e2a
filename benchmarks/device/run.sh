#!/usr/bin/env bash
# The one prepared run for a lent 16-core machine with a GPU (Python 3.12 with torch, numpy,
# psutil, pyarrow; no network): the GPU pinning benchmark, then the benchmark matrix idle and
# with busy loops on 1.5x the cores, each part bounded in time so that the whole stays under
# ~9 minutes. From the repository root, with shmstore's wheel (and any missing wheel, e.g.
# py-lmdb) in WHEELS (default .whl/):
#
#     bash benchmarks/device/run.sh OUTDIR
#
# Writes OUTDIR/{machine.txt, gpu-pin.md, matrix-idle.md, matrix-busy<N>.md, log.txt}. Changes
# no kernel or machine setting. Each step's time limit: GPU_TIMEOUT (default 150 s), PART_TIMEOUT
# (default 60 s per matrix part), MATRIX_PARTS (default format,channel,arrays).
set -uo pipefail
. "$(dirname "$0")/common.sh"
start "${1:?usage: run.sh OUTDIR}"
parts=${MATRIX_PARTS:-format,channel,arrays}

install_wheels || exit 1
{
    machine_facts
    $py -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available()); print("numpy", numpy.__version__)'
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
} | tee "$out/machine.txt"

say "GPU pinning"
timeout "${GPU_TIMEOUT:-150}" $py benchmarks/device/gpu_pin.py --out "$out/gpu-pin.md" \
    || say "gpu_pin.py ended with $?"

matrix_idle_busy "$parts" matrix
say "done"
