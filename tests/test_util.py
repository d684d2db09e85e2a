"""Shared helpers and facts that must agree everywhere: the size grammar, `pid_alive`, the
version, handles' `path`/`kind`, segment names checked by the Rust core (`shmstore rm`)."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import shmstore
from shmstore import _segments, _util, cli

ROOT = Path(__file__).resolve().parent.parent


# Each test has its own segment directory (conftest); it must leave nothing behind there.
pytestmark = pytest.mark.usefixtures("no_leftover_segments")


@pytest.mark.parametrize(
    ("text", "n"),
    [
        (0, 0),
        (1024, 1024),
        ("1024", 1024),
        ("10 MB", 10 * 10**6),
        ("10MB", 10 * 10**6),
        ("10 mb", 10 * 10**6),
        ("10 kB", 10_000),
        ("2 GB", 2 * 10**9),
        ("10 MiB", 10 * 2**20),
        ("10M", 10 * 2**20),
        ("512k", 512 * 1024),
        ("1.5GiB", 3 << 29),
        ("1 TiB", 1 << 40),
        (" 3 B ", 3),
    ],
)
def test_one_size_grammar(text, n):
    assert _util.parse_size(text) == n


@pytest.mark.parametrize("bad", ["ten", "10 XB", "-1 MB", "1e3", ""])
def test_sizes_that_are_refused(bad):
    with pytest.raises(ValueError, match="cannot read"):
        _util.parse_size(bad)


def test_size_type_errors():
    with pytest.raises(TypeError):
        _util.parse_size(True)
    with pytest.raises(TypeError):
        _util.parse_size(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        _util.parse_size(-5)


def test_the_plugin_and_joblib_use_the_same_grammar():
    from shmstore import pytest_plugin
    from shmstore.joblib import _reduce

    for text in ["10 MB", "10 MiB", "10M", "1.5GiB", "512k", 4096]:
        assert pytest_plugin.parse_bytes(text) == _util.parse_size(text)
        assert _reduce.parse_bytes(text) == _util.parse_size(text)
    assert _reduce.parse_bytes(None) == 0


def test_pid_alive_and_zombies():
    assert _util.pid_alive(os.getpid())
    assert not _util.pid_alive(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    # Wait for the exit without reaping it: the child is now a zombie.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert not _util.pid_alive(child.pid), "a zombie has exited: not alive"
    child.wait()
    assert not _util.pid_alive(child.pid)


def test_one_pid_alive_and_one_formatter():
    assert cli.pid_alive is _util.pid_alive
    assert cli.human_size is _util.format_bytes
    from shmstore.leaks import _report

    assert _report.format_bytes is _util.format_bytes


def test_version_is_written_once():
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    assert shmstore.__version__ == cargo
    assert importlib.metadata.version("shmstore") == cargo
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in pyproject and "version" in pyproject["dynamic"]


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: shmstore.SharedList([1]), "list"),
        (lambda: shmstore.SharedDict({"a": 1}), "dict"),
        (lambda: shmstore.put(1, arena=False), "object"),
    ],
)
def test_handles_have_path_and_kind(make, kind, tmp_path):
    with make() as h:
        assert h.kind == kind
        assert isinstance(h.path, Path) and h.path.name == h.name
        assert h.path.parent == _segments.segment_dir()
        assert h.path in _segments.segment_paths()
        saved = tmp_path / "saved.shmstore"
        h.save(saved)
        opened = type(h).open(saved)
        assert opened.path == saved and opened.kind == kind
        opened.close()
        h.unlink()
        h.close()
        assert h.path.name == h.name  # still known after close


def test_a_chunk_s_path_is_its_arena_s():
    with shmstore.put(1) as h:  # a small object: a chunk of this process's arena
        arena, _, chunk = h.name.partition("@")
        assert chunk and h.kind == "object"
        assert h.path.name == arena and h.path in _segments.segment_paths()
        assert _segments.arena_creator(h.path) == os.getpid()


def test_segment_names_come_from_rust():
    assert _segments.segment_name("coco") == "shmstore-coco"
    assert _segments.segment_name("shmstore-coco") == "shmstore-coco"
    for bad in ["a/b", "..", "", "x" * 300, "a.part-1"]:
        with pytest.raises(shmstore.InvalidInputError):
            _segments.segment_name(bad)


def test_rm_checks_names_like_the_core(capsys):
    for bad in ["../etc", "a b", "x" * 300, "a.part-1"]:
        assert cli.main(["rm", bad]) == cli.EXIT_USAGE
        assert "invalid segment name" in capsys.readouterr().err
    with shmstore.SharedList([1]) as lst:
        assert cli.main(["rm", lst.name.removeprefix("shmstore-")]) == cli.EXIT_OK
        assert not lst.path.exists()
        assert lst[0] == 1  # the mapping keeps working
    assert cli.main(["rm", "shmstore-no-such-store-here"]) == cli.EXIT_NOT_FOUND
    assert "no segment named 'shmstore-no-such-store-here'" in capsys.readouterr().err


def test_attach_and_open_on_the_base_class_give_the_right_class(tmp_path):
    with shmstore.SharedDict({"a": 1}) as d:
        h = shmstore.StoreHandle.attach(d.name)
        assert type(h) is shmstore.SharedDict and h["a"] == 1
        d.save(tmp_path / "d.shmstore")
        f = shmstore.StoreHandle.open(tmp_path / "d.shmstore")
        assert type(f) is shmstore.SharedDict
        with pytest.raises(shmstore.InvalidInputError, match="use SharedDict"):
            shmstore.SharedList.attach(d.name)
        h.close()
        f.close()


def test_one_message_for_a_duplicate_key():
    with pytest.raises(shmstore.InvalidInputError) as e:
        shmstore.SharedDict([("a", 1), ("b", 2), ("a", 3)])
    assert str(e.value) == (
        "pairs[2] (key 'a'): duplicate key (first given at position 0); pass a dict to keep "
        "only the last value"
    )
    # Keys equal in Python (1 == 1.0 == True) are one key here too.
    with pytest.raises(shmstore.InvalidInputError, match=r"pairs\[1\] \(key 1.0\): duplicate key"):
        shmstore.SharedDict([(1, "x"), (1.0, "y")])


def test_the_stubs_docstring_examples_run():
    """The examples in the hand-kept _native.pyi (what IDEs show) run, like the modules'
    doctests (`make doctest`)."""
    import ast
    import doctest

    from shmstore import _native

    tree = ast.parse((ROOT / "python" / "shmstore" / "_native.pyi").read_text())
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(verbose=False)
    examples = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            doc = ast.get_docstring(node)
            if doc and ">>>" in doc:
                test = parser.get_doctest(doc, dict(vars(_native)), node.name, "_native.pyi", 0)
                examples += len(test.examples)
                runner.run(test)
    # The `put(..., arena=True)` example made this process's arena: let go of it, as a
    # process done with small objects does (it lives as long as the process otherwise).
    _native._arena_release()
    assert examples > 0
    assert runner.failures == 0
