"""Find copy-on-read with shmstore.cow, then fix it (docs/guides/copy-on-read.md).

python examples/copy_on_read.py --n 20000
"""

from __future__ import annotations

import argparse
import gc

import shmstore
from shmstore import cow


def make_records(n: int) -> list[dict[str, object]]:
    return [
        {"file_name": f"{i:012d}.jpg", "annotations": [{"bbox": [1.0, 2.0, 3.0, 4.0], "id": i}]}
        for i in range(n)
    ]


def read_all(dataset: object) -> None:  # what a DataLoader worker's __getitem__ does
    for r in dataset:  # type: ignore[attr-defined]
        r["annotations"][0]["bbox"][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    n = ap.parse_args().n

    records = make_records(n)
    before = cow.measure(read_all, args=(records,), workers=4, max="1 MiB")
    print(before)  # FAIL: dict, list, float, int, str, with paths like args[0][i]['annotations']

    gc.freeze()  # spares the collector's writes only: reading still writes refcounts
    frozen = cow.measure(read_all, args=(records,), workers=4, max="1 MiB", collect=True)
    gc.unfreeze()
    print(f"\ngc.freeze(), with a collection: {frozen.excess >> 20} MiB beyond the control")

    shared = shmstore.SharedList(records)  # the fix: the records live in shared memory
    # Measured before the plain records are freed: on a free-threaded interpreter, memory the
    # parent freed just before forking is reused by whichever worker allocates next, which
    # then writes to those pages (docs/free-threading.md); the workers here read `shared` only.
    after = cow.measure(read_all, args=(shared,), workers=4, max="1 MiB")
    print(f"\nshmstore.SharedList: {after.excess / 2**20:.2f} MiB beyond the control")
    del records
    shared.unlink()
    assert not before.ok and not frozen.ok and after.ok


if __name__ == "__main__":
    main()
