"""Run a Python script with speculative store bypass disabled for this process and its
children (`prctl(PR_SET_SPECULATION_CTRL, PR_SPEC_STORE_BYPASS, PR_SPEC_DISABLE)`), as the
kernel does for processes under seccomp when its mitigation mode is "prctl" or "seccomp"
(containers, sandboxes). Every load that follows a store to the same place then waits for
it, which slows the interpreter and extensions alike; `benchmarks/probe_reads.py` run with
and without this shows by how much on a given machine.

    python benchmarks/device/ssbd_on.py benchmarks/probe_reads.py [args...]

Changes nothing outside the process it starts; fails (exit 2) where the kernel offers no
such control (a CPU not affected, or the mitigation off for the whole machine).
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_SPECULATION_CTRL = 53
PR_SPEC_STORE_BYPASS = 0
PR_SPEC_DISABLE = 4


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SPECULATION_CTRL, PR_SPEC_STORE_BYPASS, PR_SPEC_DISABLE, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"ssbd_on: the kernel refused the control: {os.strerror(err)}", file=sys.stderr)
        sys.exit(2)
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])


if __name__ == "__main__":
    main()
