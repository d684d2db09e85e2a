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
out=${1:?usage: run.sh OUTDIR}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
cores=$(nproc)
busy=${BUSY:-$(( cores * 3 / 2 ))}
parts=${MATRIX_PARTS:-format,channel,arrays}
nparts=$(( $(tr -cd , <<<"$parts" | wc -c) + 1 ))
part_timeout=${PART_TIMEOUT:-60}
# matrix.py bounds each part; this bounds the whole run a little above that (it writes its
# markdown only at the end).
matrix_timeout=$(( part_timeout * nparts + 30 ))
. "$(dirname "$0")/common.sh"

install_wheels || exit 1
{
    machine_facts
    $py -c 'import torch, numpy; print("torch", torch.__version__, "cuda", torch.cuda.is_available()); print("numpy", numpy.__version__)'
    nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not found"
} | tee "$out/machine.txt"

say "GPU pinning"
timeout "${GPU_TIMEOUT:-150}" $py benchmarks/device/gpu_pin.py --out "$out/gpu-pin.md" \
    || say "gpu_pin.py ended with $?"

say "matrix idle ($parts)"
timeout "$matrix_timeout" $py benchmarks/matrix.py --device --busy 0 \
    --label "device-idle" --only "$parts" --part-timeout "$part_timeout" \
    --out "$out/matrix-idle.md" || say "matrix idle ended with $?"

say "matrix with $busy busy loops ($parts)"
timeout "$matrix_timeout" $py benchmarks/matrix.py --device --busy "$busy" \
    --label "device-busy$busy" --only "$parts" --part-timeout "$part_timeout" \
    --out "$out/matrix-busy$busy.md" || say "matrix busy ended with $?"
say "done"
