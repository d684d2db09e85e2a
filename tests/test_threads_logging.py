"""Concurrent readers in one process, and Rust log records reaching Python logging."""

import logging
import threading

import shmstore


def test_threads_read_one_store_concurrently():
    records = [
        {"id": i, "tags": [f"t{i % 7}", i * 0.5], "nested": {"k": (i, str(i))}} for i in range(3000)
    ]
    with shmstore.SharedList(records) as lst:
        errors: list[BaseException] = []
        start = threading.Barrier(8)

        def reader(offset: int) -> None:
            try:
                start.wait()
                it = iter(lst)  # one shared iterator across threads is also allowed
                for k in range(len(lst)):
                    i = (k * 7 + offset) % len(lst)
                    r = lst[i]
                    assert r["id"] == i
                    assert r["tags"][1] == i * 0.5
                    assert r["nested"]["k"] == (i, str(i))
                    next(it, None)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_close_while_other_threads_hold_views():
    lst = shmstore.SharedList([{"x": list(range(50))}] * 200)
    views = [lst[i] for i in range(200)]
    done = threading.Event()

    def reader() -> None:
        for v in views:
            assert v["x"][49] == 49
        done.set()

    t = threading.Thread(target=reader)
    lst.close()  # drops only the handle's reference: the views keep the mapping alive
    t.start()
    t.join()
    assert done.is_set()


def test_rust_logs_reach_python_logging(caplog):
    with caplog.at_level(logging.DEBUG, logger="shmstore"):
        with shmstore.SharedList([1, 2, 3]) as lst:
            name = lst.name
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("shmstore")]
    assert any(name in m and "created" in m for m in messages), messages


def test_rust_logs_use_public_logger_names_one_line_per_event(caplog):
    """Records from the Rust core go to loggers named by what they are about
    (``shmstore.store``), not by Rust module paths (``shmstore.py.store``); an unlink logs
    once even when ``with`` unlinks again after an explicit ``unlink()``."""
    with caplog.at_level(logging.DEBUG, logger="shmstore"):
        with shmstore.SharedList([1, 2, 3]) as lst:
            name = lst.name
            lst.unlink()
    mine = [r for r in caplog.records if name in r.getMessage()]
    assert {r.name for r in mine} == {"shmstore.store"}, [(r.name, r.getMessage()) for r in mine]
    unlinked = [r for r in mine if r.getMessage().startswith("unlinked")]
    assert len(unlinked) == 1, [r.getMessage() for r in mine]
