"""Deterministic synthetic COCO-like records (the dataset of the acceptance benchmarks).

Each record is a plain dict shaped like one image of COCO's ``instances_train`` metadata::

    {"file_name": "000000000001.jpg", "height": 480, "width": 640, "image_id": 1,
     "annotations": [  # 1 to 11 of them, uniformly
         {"bbox": [x, y, w, h], "category_id": 18, "area": 1234.56, "iscrowd": 0, "id": 1},
         ...]}

bboxes lie inside the image; floats are rounded to 2 decimals as in COCO's JSON; annotation ids are
unique over the whole data set. The same ``(n, seed)`` gives the same records on every run and
machine (numpy's PCG64 stream), and the first records of ``make_records(n)`` are
``make_records(m)`` for m < n. ``iter_records`` yields exactly the records ``make_records``
returns, without ever holding them all. 200k records take about 1 second.
"""

from __future__ import annotations

import gc
from typing import Any, Iterator

import numpy as np

# Records are drawn in blocks of this many; it fixes how the random stream is consumed, so it is
# part of the data set's definition: changing it changes the records. Small, so that streaming
# through iter_records leaves no heap fragments behind (8192 left 9 MiB in the memory benchmark).
_BLOCK = 256


def iter_records(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``n`` COCO-like records, one at a time (streaming: memory stays at one block)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    next_ann_id = 1
    for start in range(0, n, _BLOCK):
        m = min(_BLOCK, n - start)
        # Always draw a whole block (and use its first m images), so that the first records of a
        # larger data set are the records of a smaller one.
        heights = rng.integers(240, 641, _BLOCK)
        widths = rng.integers(240, 641, _BLOCK)
        counts = rng.integers(1, 12, _BLOCK)  # 1..11 annotations per image
        k = int(counts.sum())
        # Each annotation's image size, to keep its bbox inside the image.
        img_w = np.repeat(widths, counts).astype(np.float64)
        img_h = np.repeat(heights, counts).astype(np.float64)
        u = rng.random((k, 5))
        cats = rng.integers(1, 91, k)
        crowd = (rng.random(k) < 0.01).astype(np.int64)
        k = int(counts[:m].sum())  # the annotations of the images used
        x = np.round(u[:k, 0] * (img_w[:k] - 2.0), 2)
        y = np.round(u[:k, 1] * (img_h[:k] - 2.0), 2)
        w = np.round(1.0 + u[:k, 2] * (img_w[:k] - x - 2.0), 2)
        h = np.round(1.0 + u[:k, 3] * (img_h[:k] - y - 2.0), 2)
        areas = np.round(w * h * (0.4 + 0.6 * u[:k, 4]), 2).tolist()
        bboxes = np.stack([x, y, w, h], axis=1).tolist()
        cats = cats[:k].tolist()
        crowd = crowd[:k].tolist()
        heights, widths, counts = heights[:m], widths[:m], counts[:m]

        pos = 0
        for i, (hh, ww, c) in enumerate(zip(heights.tolist(), widths.tolist(), counts.tolist())):
            anns = [
                {
                    "bbox": bboxes[j],
                    "category_id": cats[j],
                    "area": areas[j],
                    "iscrowd": crowd[j],
                    "id": next_ann_id + j,
                }
                for j in range(pos, pos + c)
            ]
            pos += c
            image_id = start + i + 1
            yield {
                "file_name": f"{image_id:012d}.jpg",
                "height": hh,
                "width": ww,
                "image_id": image_id,
                "annotations": anns,
            }
        next_ann_id += k


def make_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` COCO-like records as a list of plain dicts (see the module docstring)."""
    # The cyclic GC would rescan the growing list over and over (3x slower); nothing here is cyclic.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return list(iter_records(n, seed))
    finally:
        if was_enabled:
            gc.enable()


if __name__ == "__main__":
    import sys
    import time

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    t0 = time.perf_counter()
    recs = make_records(count)
    dt = time.perf_counter() - t0
    n_ann = sum(len(r["annotations"]) for r in recs)
    print(f"{count} records, {n_ann} annotations in {dt:.2f} s; first: {recs[0]}")
