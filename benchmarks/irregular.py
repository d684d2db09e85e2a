"""Deterministic irregular records: the second data set of the format benchmark.

COCO-like records (coco.py) are regular: every image has the same keys, every value of a field the
same type. Records loaded from JSON lines usually are not. These are small event-log records with:

- 6 fields always present: ``id`` (int), ``ts`` (int, epoch seconds), ``user`` (str),
  ``event`` (str from a vocabulary of 12), ``score`` and ``value``;
- mixed value types per field: ``score`` is a float (70 %), an int (15 %) or None (15 %);
  ``value`` an int (40 %), a float (25 %), a str (25 %) or None (10 %);
- 6 optional fields, each absent from a fixed share of the records, 5 % to 30 %:
  ``session`` (str, 5 %), ``ok`` (bool, 10 %), ``tags`` (list of 0-4 short str, 15 %),
  ``ref`` (str or None, 20 %), ``geo`` (dict ``lat``/``lon`` floats, a ``city`` str in half of
  them, 25 %), ``props`` (dict of 1-3 keys out of 10, values int/float/str/None/list, 30 %);
- nested lists and dicts sometimes (``tags``, ``geo``, ``props``, and a list value inside
  ``props``); ints up to 2**40 now and then (``ts`` in milliseconds in 10 % of the records).

So there are many distinct key sets (the optional fields combine freely, ``props`` draws its keys)
and no field has one type throughout: 64 distinct top-level key sets in 200k records, about 215
bytes pickled per record. The same ``(n, seed)`` gives the same records on every run and
machine (``random.Random``, whose sequence for a given seed is stable across Python versions),
and the first records of ``make_records(n)`` are ``make_records(m)`` for m < n. 200k records
take about 2 seconds.

``touch`` / ``touch_pickle`` are this data set's field-access loop (the same accesses whatever
holds the records), like ``_common.touch_sequence`` / ``touch_pickle`` for COCO.
"""

from __future__ import annotations

import gc
import pickle
import random
from typing import Any, Iterator, Sequence

EVENTS = (
    "click",
    "view",
    "purchase",
    "login",
    "logout",
    "search",
    "share",
    "like",
    "comment",
    "error",
    "signup",
    "scroll",
)
PROP_KEYS = (
    "color",
    "size",
    "qty",
    "price",
    "variant",
    "page",
    "campaign",
    "rank",
    "items",
    "note",
)
CITIES = ("Paris", "Lagos", "Lima", "Osaka", "Pune", "Oslo", "Austin", "Hanoi")
WORDS = ("red", "blue", "new", "sale", "beta", "vip", "eu", "us", "mobile", "web", "ios", "ad")


def _prop_value(rng: random.Random) -> Any:
    u = rng.random()
    if u < 0.3:
        return rng.randrange(1000)
    if u < 0.55:
        return round(rng.uniform(0, 500), 2)
    if u < 0.8:
        return rng.choice(WORDS)
    if u < 0.9:
        return None
    return [rng.randrange(100) for _ in range(rng.randrange(1, 4))]


def _record(rng: random.Random, i: int) -> dict[str, Any]:
    ts = 1_700_000_000 + i * 7 + rng.randrange(7)
    if rng.random() < 0.1:
        ts *= 1000  # milliseconds: a wide int
    rec: dict[str, Any] = {
        "id": i,
        "ts": ts,
        "user": f"u{rng.randrange(50_000)}",
        "event": rng.choice(EVENTS),
    }
    u = rng.random()
    rec["score"] = round(rng.random(), 4) if u < 0.7 else (rng.randrange(100) if u < 0.85 else None)
    u = rng.random()
    if u < 0.4:
        rec["value"] = rng.randrange(-1000, 100_000)
    elif u < 0.65:
        rec["value"] = round(rng.uniform(-10, 10), 3)
    elif u < 0.9:
        rec["value"] = rng.choice(WORDS) + str(rng.randrange(100))
    else:
        rec["value"] = None
    # Optional fields: each draws its presence first, so the stream is consumed the same way
    # whatever the earlier fields were.
    if rng.random() >= 0.05:
        rec["session"] = f"s{rng.randrange(1 << 32):08x}"
    if rng.random() >= 0.10:
        rec["ok"] = rng.random() < 0.9
    if rng.random() >= 0.15:
        rec["tags"] = [rng.choice(WORDS) for _ in range(rng.randrange(5))]
    if rng.random() >= 0.20:
        rec["ref"] = None if rng.random() < 0.3 else f"/p/{rng.randrange(10_000)}"
    if rng.random() >= 0.25:
        geo: dict[str, Any] = {
            "lat": round(rng.uniform(-90, 90), 5),
            "lon": round(rng.uniform(-180, 180), 5),
        }
        if rng.random() < 0.5:
            geo["city"] = rng.choice(CITIES)
        rec["geo"] = geo
    if rng.random() >= 0.30:
        keys = rng.sample(PROP_KEYS, rng.randrange(1, 4))
        rec["props"] = {k: _prop_value(rng) for k in keys}
    return rec


def iter_records(n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """Yield ``n`` irregular records, one at a time (see the module docstring)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(seed)
    for i in range(n):
        yield _record(rng, i)


def make_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Return ``n`` irregular records as a list of plain dicts."""
    was_enabled = gc.isenabled()
    gc.disable()  # nothing here is cyclic; the GC would rescan the growing list
    try:
        return list(iter_records(n, seed))
    finally:
        if was_enabled:
            gc.enable()


def touch(seq: Sequence[Any]) -> float:
    """Field-access loop over a sequence of records (plain list or SharedList), in order:
    ``id``, ``event``, ``score`` (may be None), optional ``tags`` (its length) and ``geo.lat``."""
    return sum(_read(seq[i]) for i in range(len(seq)))


def _read(rec: Any) -> float:
    """The fields one record's read touches (the same for every approach)."""
    acc = rec["id"] + len(rec["event"])
    s = rec["score"]
    if s is not None:
        acc += s
    t = rec.get("tags")
    if t is not None:
        acc += len(t)
    g = rec.get("geo")
    if g is not None:
        acc += g["lat"]
    return float(acc)


def touch_pickle(pb: Any) -> float:
    """The same loop over a ``_common.PickleBuffer``: unpickle each record, then read it."""
    loads = pickle.loads
    mv = memoryview(pb.buf)
    off = memoryview(pb.offsets)
    return sum(_read(loads(mv[off[i] : off[i + 1]])) for i in range(len(off) - 1))


if __name__ == "__main__":
    import sys
    import time

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    t0 = time.perf_counter()
    recs = make_records(count)
    dt = time.perf_counter() - t0
    size = sum(len(pickle.dumps(r, protocol=pickle.HIGHEST_PROTOCOL)) for r in recs)
    shapes = len({tuple(r) for r in recs})
    print(
        f"{count} records in {dt:.2f} s, {size / count:.0f} B pickled per record, "
        f"{shapes} distinct top-level key sets; first: {recs[0]}"
    )
