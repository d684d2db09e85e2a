"""Typed use of shmstore: what a type checker infers and accepts.

    python examples/typed_usage.py

`make lint` checks this file with `mypy --strict` and with pyright (basedpyright). The
comments say what each checker infers; `reveal_type` is not used so that the script also runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import shmstore
from shmstore.torch import SharedListDataset


def mean_area(records: Sequence[Mapping[str, Any]]) -> float:
    """Generic code over records: takes a plain list of dicts or a SharedList alike."""
    areas: list[float] = [a["area"] for r in records for a in r["annotations"]]
    return sum(areas) / len(areas)


def lookup(index: Mapping[str, Any], key: str) -> Any:
    return index.get(key)


def main() -> None:
    records = [
        {"file_name": f"{i:06d}.jpg", "annotations": [{"area": float(i)}, {"area": 1.0}]}
        for i in range(100)
    ]
    # SharedList[DictView]: records come back as read-only views, a DictView is a Mapping
    with shmstore.SharedList(records) as lst:
        first: shmstore.DictView = lst[0]
        assert first["file_name"] == "000000.jpg"
        print("mean area:", mean_area(lst), "==", mean_area(records))
        head: list[shmstore.DictView] = lst[:2]  # a slice is a plain list of views
        assert len(head) == 2

    # SharedList[int]: scalars come back as the same type
    with shmstore.SharedList(range(10)) as numbers:
        total: int = sum(numbers)
        print("sum:", total)

    # SharedDict[str]: a Mapping with str keys; values are views or scalars (Any)
    with shmstore.SharedDict({f"doc-{i}": f"text {i}" for i in range(5)}) as docs:
        keys: list[str] = sorted(docs)
        print(keys[0], "->", lookup(docs, "doc-1"))

    # put(): one object, read back as a read-only numpy array
    with shmstore.put(np.arange(4.0)) as ref:
        print("array sum:", float(ref.get().sum()))

    # A torch-style dataset: a Dataset[str] for type checkers (see below)
    with shmstore.SharedList(records) as lst:
        names: SharedListDataset[str] = SharedListDataset(lst, transform=lambda r: r["file_name"])
        print("dataset:", len(names), names[3])

    if TYPE_CHECKING:  # checked, not run: torch is too big for this example's dependencies
        from torch.utils.data import DataLoader

        loader: DataLoader[str] = DataLoader(names, batch_size=8, num_workers=2)
        del loader


if __name__ == "__main__":
    main()
