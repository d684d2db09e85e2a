# Sourced by the device scripts (run.sh, soak.sh, reads.sh): the start they share (an output
# directory that logs everything, the interpreter, the wheels, the busy loops), installing
# the carried wheels, the machine's facts, and the matrix idle then busy.

stamp() { date +%H:%M:%S; }
say() { echo "[$(stamp)] $*"; }

# Make the output directory $1, send everything from here on to its log.txt too, and set
# `out`, `py` (PYTHON, default python3), `wheels` (WHEELS, default .whl), `cores`, `busy`
# (BUSY, default 1.5x the cores) and `part_timeout` (PART_TIMEOUT, default 60 s).
start() {
    out=$1
    mkdir -p "$out"
    exec > >(tee -a "$out/log.txt") 2>&1
    py=${PYTHON:-python3}
    wheels=${WHEELS:-.whl}
    cores=$(nproc)
    busy=${BUSY:-$(( cores * 3 / 2 ))}
    part_timeout=${PART_TIMEOUT:-60}
}

# Install every wheel in DIR (default $wheels) into TARGET (default /tmp/site, then put on
# PYTHONPATH) with no network and no dependencies; nothing to do without wheels.
install_wheels() {
    local dir=${1:-$wheels} target=${2:-/tmp/site}
    if ls "$dir"/*.whl >/dev/null 2>&1; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$target" "$dir"/*.whl || return 1
        [ -n "${2:-}" ] || export PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH}
    fi
}

# The matrix's PARTS (comma-separated) idle, then with $busy busy loops, into
# $out/NAME-idle.md and $out/NAME-busy<N>.md. matrix.py bounds each part by $part_timeout;
# this bounds a whole run a little above that (it writes its markdown only at the end).
matrix_idle_busy() {
    local parts=$1 name=$2 b run
    local n=$(( $(tr -cd , <<<"$parts" | wc -c) + 1 ))
    for b in 0 "$busy"; do
        run=$([ "$b" = 0 ] && echo idle || echo "busy$b")
        say "matrix ($parts), $run"
        timeout $(( part_timeout * n + 30 )) $py benchmarks/matrix.py --device --busy "$b" \
            --label "device-$name-$run" --only "$parts" --part-timeout "$part_timeout" \
            --out "$out/$name-$run.md" || say "matrix ($parts, $run) ended with $?"
    done
}

# The machine's facts (date, CPUs, memory, load, interpreter, user, shmstore), one per line.
machine_facts() {
    echo "date: $(date -u +%FT%TZ)"
    echo "cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo)"
    lscpu 2>/dev/null | grep -E '^(Thread|Core|Socket|NUMA node\(s\)|L3)' | sed 's/  */ /g'
    echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "python: $($py --version 2>&1)"
    echo "user: $(id -un) (uid $(id -u))"
    $py -c 'import shmstore; print("shmstore", shmstore.__version__, shmstore.__file__)'
    $py -c 'import shmstore._native as n; off = {k: v for k, v in n._fast_paths().items() if v is not True}; print("fast paths off:", off or "none")'
}
