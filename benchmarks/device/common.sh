# Sourced by the device scripts (run.sh, soak.sh): install the carried wheels and write the
# machine's facts. Expects `py` (the interpreter) and `wheels` (a directory) to be set.

stamp() { date +%H:%M:%S; }
say() { echo "[$(stamp)] $*"; }

# Install every wheel in $wheels into /tmp/site (no network, no dependencies) and put it on
# PYTHONPATH; nothing to do without wheels.
install_wheels() {
    if ls "$wheels"/*.whl >/dev/null 2>&1; then
        $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$wheels"/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
}

# The machine's facts (date, CPUs, memory, load, interpreter, user, shmstore), one per line.
machine_facts() {
    echo "date: $(date -u +%FT%TZ)"
    echo "cores: $(nproc); $(grep -m1 'model name' /proc/cpuinfo)"
    echo "memory: $(free -g | awk '/Mem:/ {print $2 " GiB"}')"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "python: $($py --version 2>&1)"
    echo "user: $(id -un) (uid $(id -u))"
    $py -c 'import shmstore; print("shmstore", shmstore.__version__, shmstore.__file__)'
    $py -c 'import shmstore._native as n; off = {k: v for k, v in n._fast_paths().items() if v is not True}; print("fast paths off:", off or "none")'
}
