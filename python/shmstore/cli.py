"""The ``shmstore`` command: ``ls | inspect NAME | gc [--dry-run] | rm NAME...``.

Also ``python -m shmstore``. Every verb takes ``--json`` (machine-readable output on stdout).
A user error prints one line, ``shmstore VERB: what went wrong``, to stderr (no traceback) and
exits with a code that says what kind of error it was:

====  ==========================================================================================
code  meaning
====  ==========================================================================================
0     success
1     a named store does not exist (``inspect``, ``rm``), or ``gc --dry-run`` found orphans
2     usage error: unknown verb or option, or a name shmstore would never give a store
3     the target exists but is not a readable store (corrupt, truncated, a directory, a
      foreign file)
4     permission denied, or another error of the operating system; the output could not
      be written (``shmstore ls > /dev/full``, stdout closed: ``shmstore ls >&-``)
130   interrupted (Ctrl-C)
141   stdout was closed early (``shmstore ls --json | head``): the output stops quietly, as a
      program killed by SIGPIPE would (128 + 13)
====  ==========================================================================================

A store the process that built it still maps is listed under its public name with its state
(``in use``), never under its build name. ``ls`` states: ``in use``, ``orphaned`` (no process
uses it: ``gc`` removes it), ``building``, ``unreadable``, and ``unsealed``: a file named like a
segment that shmstore did not seal (an archive copied or saved there by hand, mode other than
0400 or without the writer's mark), which ``gc`` never removes (it is not shmstore's to
remove); ``shmstore rm NAME`` does.

>>> main(["ls", "--json"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Optional

from shmstore import _native
from shmstore._native import (
    CorruptStoreError,
    InvalidInputError,
    ShmStoreError,
    StoreNotFoundError,
    StorePermissionError,
)
from shmstore._segments import (
    arena_creator,
    channel_creator,
    remove,
    search_dirs,
    segment_name,
    segment_paths,
    segment_users,
)
from shmstore._util import format_bytes as human_size
from shmstore._util import pid_alive

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_OS_ERROR",
    "EXIT_UNREADABLE",
    "EXIT_USAGE",
    "main",
]

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNREADABLE = 3
EXIT_OS_ERROR = 4
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class UserError(Exception):
    """An error to report in one line, with its exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _classify(e: BaseException, target: str) -> UserError:
    """The one line and exit code for an exception raised while handling ``target``."""
    if isinstance(e, UserError):
        return e
    said = str(e) or type(e).__name__
    line = said if target in said else f"{target}: {said}"
    if isinstance(e, (StoreNotFoundError, FileNotFoundError)):
        return UserError(line, EXIT_NOT_FOUND)
    if isinstance(e, IsADirectoryError):
        return UserError(f"{target}: is a directory, not a store", EXIT_UNREADABLE)
    if isinstance(e, CorruptStoreError):
        return UserError(f"not a readable store: {line}", EXIT_UNREADABLE)
    if isinstance(e, InvalidInputError):
        return UserError(line, EXIT_USAGE)
    if isinstance(e, (PermissionError, StorePermissionError)):
        return UserError(f"permission denied: {line}", EXIT_OS_ERROR)
    if isinstance(e, (ShmStoreError, OSError)):
        return UserError(line, EXIT_OS_ERROR)
    raise e


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2))


# ---------------------------------------------------------------------------------------------
# ls


# The writer's seal mark: the nanoseconds of a sealed segment's modification time
# (SEALED_MTIME_NSEC, src/segment/mod.rs). gc removes only sealed files, arenas, channels and
# files being built (the same rule as the sweep's), so ls says which files it would not.
_SEALED_MTIME_NSEC = 314_159_265


def _sealed(path: Path, st: os.stat_result, kind: Any) -> bool:
    """Whether ``gc`` treats the file as shmstore's own (see the sweep's ``is_segment``)."""
    mode = stat.S_IMODE(st.st_mode)
    if kind in ("building", "channel"):
        return mode == 0o600
    marked = st.st_mtime_ns % 1_000_000_000 == _SEALED_MTIME_NSEC
    return mode in (0o400, 0o500) and (marked or (mode == 0o400 and kind == "arena"))


def _state(row: dict[str, Any]) -> str:
    if row["kind"] == "building":
        return "building"
    if row["kind"] is None or str(row["kind"]).startswith("unreadable"):
        return "unreadable"
    if row["users"]:
        return "in use"
    return "orphaned" if row["sealed"] else "unsealed"


def _rows() -> list[dict[str, Any]]:
    try:
        sup = _native.supervisor_info()
    except OSError as e:  # running but not answering: list the files, say what is missing
        print(f"shmstore ls: no information from the supervisor: {e}", file=sys.stderr)
        sup = None
    tracked: dict[str, list[int]] = sup["segments"] if sup else {}
    paths = segment_paths()
    users = segment_users(paths)
    rows: list[dict[str, Any]] = []
    for path in paths:
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        row: dict[str, Any] = {
            "name": path.name,
            "path": str(path),
            "size": st.st_size,
            # Whole seconds of the mtime: a segment's sub-second part is the writer's seal
            # mark (src/segment/mod.rs), not a time, and could make a new store look younger
            # than 0.
            "age_s": round(time.time() - st.st_mtime_ns // 1_000_000_000, 1),
            "kind": None,
            "records": None,
            "creator_pid": None,
            "creator_alive": None,
            "users": sorted(users.get(path, [])),
            "attached_pids": tracked.get(str(path), []),
            "tracked": str(path) in tracked,
        }
        if ".part-" in path.name:
            row["kind"] = "building"
        else:
            try:
                info = _native._store_info(str(path))
                row.update(
                    kind=info["kind"], records=info["count"], creator_pid=info["creator_pid"]
                )
                row["creator_alive"] = pid_alive(info["creator_pid"])
            except (ShmStoreError, OSError) as e:  # a corrupt or foreign file: still list it
                # Many small objects' chunks (docs/arena.md), or a channel's ring of
                # handles (docs/channel.md): no records of their own.
                for kind, creator in (
                    ("arena", arena_creator(path)),
                    ("channel", channel_creator(path)),
                ):
                    if creator is not None:
                        row.update(kind=kind, creator_pid=creator)
                        row["creator_alive"] = pid_alive(creator)
                        break
                else:
                    row["kind"] = f"unreadable ({type(e).__name__})"
        row["sealed"] = _sealed(path, st, row["kind"])
        row["state"] = _state(row)
        rows.append(row)
    return rows


def _ls(args: argparse.Namespace) -> int:
    rows = _rows()
    if args.json:
        _emit_json(rows)
        return EXIT_OK
    if not rows:
        print("no shmstore segments in " + ", ".join(str(d) for d in search_dirs()))
        return EXIT_OK
    print(
        f"{'NAME':42} {'SIZE':>10} {'KIND':9} {'STATE':10} {'RECORDS':>9} {'CREATOR':>12} "
        f"{'AGE':>7}  USERS"
    )
    for r in rows:
        creator = ""
        if r["creator_pid"] is not None:
            creator = f"{r['creator_pid']}{'' if r['creator_alive'] else ' (dead)'}"
        records = "" if r["records"] is None else str(r["records"])
        # An unreadable file's reason is in --json; the column keeps its width.
        kind = "-" if r["state"] == "unreadable" else str(r["kind"])
        print(
            f"{r['name']:42} {human_size(r['size']):>10} {kind:9} {r['state']:10} "
            f"{records:>9} {creator:>12} {r['age_s']:>6.0f}s  "
            f"{','.join(map(str, r['users'])) or '-'}"
        )
    unsealed = [r["name"] for r in rows if r["state"] == "unsealed"]
    if unsealed:
        print(
            f"unsealed: {len(unsealed)} file(s) named like segments that shmstore did not seal "
            "(copied or saved there by hand): gc leaves them; shmstore rm NAME removes one"
        )
    return EXIT_OK


# ---------------------------------------------------------------------------------------------
# inspect, gc, rm


def _arena_path(target: str) -> Path | None:
    """The arena file ``target`` names (an arena's name, or the arena part of a chunk's
    ``<arena>@<offset>:<size>:<generation>``), if it is one; else None."""
    name = target.split("@", 1)[0]
    if "/" in name or not name:
        return None
    try:
        full = segment_name(name)
    except InvalidInputError:
        return None
    for d in search_dirs():
        path = d / full
        if path.exists() and arena_creator(path) is not None:
            return path
    return None


def _inspect_arena(args: argparse.Namespace, path: Path) -> int:
    """An arena's header and chunks; for a chunk's name, also the object it holds."""
    target = args.name
    offset = None
    if "@" in target:
        try:
            offset = int(target.split("@", 1)[1].split(":", 1)[0])
        except ValueError:
            raise UserError(
                f"{target!r} is not a chunk name (<arena>@<offset>:<size>:<generation>)",
                EXIT_USAGE,
            ) from None
    try:
        info: dict[str, Any] = {"name": path.name, "path": str(path), "kind": "arena"}
        info.update(_native._arena_info(path))
        if offset is not None:
            obj = dict(_native._store_info(target))
            obj.update(_copy_fields(target, obj, verify=args.verify))
            obj["chunk"] = next((c for c in info["chunks"] if c["offset"] == offset), None)
            info = obj
    except Exception as e:
        raise _classify(e, target) from e
    if args.json:
        _emit_json(info)
        return EXIT_OK
    chunks = info.pop("chunks", None)
    for k, v in info.items():
        shown = human_size(v) if k.endswith("nbytes") or k == "capacity" else v
        print(f"{k:16} {shown}")
    if chunks is not None:
        used = sum(c["size"] for c in chunks if c["state"] in ("leased", "unleased"))
        print(f"{'chunks':16} {sum(c['generation'] is not None for c in chunks)}")
        print(f"{'in chunks':16} {human_size(used)}")
        print(f"{'offset':>12} {'size':>10} {'generation':>10}  state")
        for c in chunks:
            gen = "-" if c["generation"] is None else c["generation"]
            print(f"{c['offset']:>12} {c['size']:>10} {gen:>10}  {c['state']}")
    return EXIT_OK


def _inspect(args: argparse.Namespace) -> int:
    target = args.name
    if ("/" in target or target == ".") and Path(target).is_dir():
        raise UserError(f"{target}: is a directory, not a store", EXIT_UNREADABLE)
    arena = _arena_path(target)
    if arena is not None:
        return _inspect_arena(args, arena)
    try:
        info = dict(_native._store_info(target))
        if info["name"] == info["path"] and _segment_by_path(Path(str(info["path"]))):
            # a segment given by its path (/dev/shm/shmstore-x): a segment, not a saved file
            info["name"] = Path(str(info["path"])).name
        info.update(_copy_fields(target, info, verify=args.verify))
    except Exception as e:
        raise _classify(e, args.name) from e
    if args.json:
        _emit_json(info)
    else:
        for k, v in info.items():
            shown = human_size(v) if k.endswith("nbytes") else v
            print(f"{k:16} {shown}")
    return EXIT_OK


def _copy_fields(target: str, info: dict[str, Any], verify: bool = False) -> dict[str, Any]:
    """The archive's content digest (xxh3-128, what ``shmstore.cluster`` verifies copies
    against; hashes the whole archive) and where this copy comes from: "built here", "fetched"
    (a copy made by ``shmstore.cluster`` from another machine) or "saved file". With
    ``verify``, every record and every array's data is checked first (``verify()``)."""
    import shmstore

    is_file = info["name"] == info["path"]
    h = (
        shmstore.StoreHandle.open(str(info["path"]))
        if is_file
        else shmstore.StoreHandle.attach(str(info["name"]))
    )
    try:
        if verify:
            h.verify()
        ident = _native._cluster_identity(h, True)
    finally:
        h.close()
    copy = "saved file" if is_file else ("fetched" if ident["fetched"] else "built here")
    out = {"digest": ident["digest"], "copy": copy}
    if verify:
        out["verified"] = True
    return out


def _segment_by_path(path: Path) -> Path | None:
    """``path`` if it is a file in a segment directory named like a segment, else None."""
    try:
        parent = path.resolve().parent
        dirs = {d.resolve() for d in search_dirs()}
    except OSError:
        return None
    if parent in dirs and path.name.startswith("shmstore-") and ".part-" not in path.name:
        return path
    return None


def _gc(args: argparse.Namespace) -> int:
    try:
        report = _native.sweep(dry_run=args.dry_run)
    except Exception as e:
        raise _classify(e, "sweep") from e
    orphans = [r for r in report if r["removed"]]
    freed = sum(r["size"] for r in orphans)
    status = EXIT_NOT_FOUND if (args.dry_run and orphans) else EXIT_OK
    if args.json:
        _emit_json(
            {
                "dry_run": args.dry_run,
                "segments": [dict(r) for r in report],
                "removed": len(orphans),
                "freed_bytes": freed,
            }
        )
        return status
    verb = "would remove" if args.dry_run else "removed"
    for r in report:
        if r["removed"]:
            print(f"{verb} {r['path']} ({human_size(r['size'])})")
        elif args.verbose and r.get("locked"):
            print(f"kept {r['path']}: locked by a reader that bypasses the supervisor")
        elif args.verbose:
            print(f"kept {r['path']}: used by {r['users']}")
    print(f"{verb} {len(orphans)} orphaned segment(s), {human_size(freed)}")
    return status


def _full_name(name: str) -> str:
    """``name`` with the prefix, checked by the core's naming rule: a name shmstore never
    gives a store is a usage error."""
    try:
        return segment_name(name)
    except InvalidInputError as e:
        raise UserError(f"{name!r} is not a store name ({e})", EXIT_USAGE) from None


def _rm(args: argparse.Namespace) -> int:
    status = EXIT_OK
    results: list[dict[str, Any]] = []
    for name in args.names:
        row: dict[str, Any] = {"name": name, "path": None, "removed": False, "error": None}
        results.append(row)
        try:
            full = _full_name(name)
            path = remove(full)
            if path is None:
                for d in search_dirs():
                    there = d / full
                    if there.is_symlink() or there.exists():
                        what = _what_is(there)
                        raise UserError(
                            f"{there} is {what}, not a segment: rm removes only segment files "
                            "(remove it yourself if it is yours)",
                            EXIT_UNREADABLE,
                        )
                raise UserError(f"no segment named {full!r}", EXIT_NOT_FOUND)
            row.update(path=str(path), removed=True)
        except Exception as e:
            err = _classify(e, name)
            row["error"] = str(err)
            _complain(args.cmd, str(err))
            status = max(status, err.code)
    if args.json:
        _emit_json(results)
    return status


def _what_is(path: Path) -> str:
    try:
        st = path.lstat()
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "a special file (FIFO, socket or device)"
    if st.st_uid != os.geteuid():
        return f"a file of another user (uid {st.st_uid})"
    return "a file that is not a segment"


# ---------------------------------------------------------------------------------------------
# main


def _complain(verb: Optional[str], message: str) -> None:
    print(f"shmstore{' ' + verb if verb else ''}: {message}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line (plus the usage) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        _complain(None, message)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shmstore", description="Manage shmstore segments.")
    p.add_argument("--version", action="version", version=f"shmstore {_native.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def verb(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        v = sub.add_parser(name, help=help)
        v.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        v.set_defaults(fn=fn)
        return v

    verb("ls", _ls, "list this user's segments (size, kind, state, creator, users)")
    ins = verb(
        "inspect",
        _inspect,
        "show a store's header (a name, or a saved file's path); of an arena, its chunks",
    )
    ins.add_argument("name")
    ins.add_argument(
        "--verify",
        action="store_true",
        help="check every record and every array's data against its checksum (reads it all)",
    )
    gc = verb("gc", _gc, "remove orphaned segments (no live process maps them)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.add_argument("-v", "--verbose", action="store_true", help="also list what is kept")
    rm = verb("rm", _rm, "unlink segments by name (mappings in use keep working)")
    rm.add_argument("names", nargs="+")
    return p


def _broken_pipe() -> int:
    # Whatever is still buffered for the closed pipe would fail again at exit: point stdout
    # at /dev/null so the interpreter's final flush is silent.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


class _ClosedStdout:
    """Stands for a closed stdout (``shmstore ls >&-``, where Python sets ``sys.stdout`` to
    None): writing fails as writing to a closed descriptor does, flushing has nothing to do."""

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")

    def flush(self) -> None:
        pass


# Errors of writing the output (not of the segments, which _classify reports).
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EBADF, errno.EFBIG, errno.EDQUOT}


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of the ``shmstore`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    try:
        code = int(args.fn(args))
        sys.stdout.flush()
        return code
    except UserError as e:
        _complain(args.cmd, str(e))
        return e.code
    except BrokenPipeError:
        return _broken_pipe()
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        # Like coreutils (`ls > /dev/full`: "write error: No space left on device"): one
        # line, exit status 4, and nothing left buffered for the interpreter to fail on.
        _complain(args.cmd, f"cannot write the output: {e.strerror or e}")
        if not isinstance(sys.stdout, _ClosedStdout):
            _broken_pipe()
        return EXIT_OS_ERROR
    except KeyboardInterrupt:
        _complain(args.cmd, "interrupted")
        return EXIT_INTERRUPTED
