"""Command line: ``shmstore ls | inspect NAME | gc [--dry-run] | rm NAME...``.

Also ``python -m shmstore``. Exit codes: 0 success; 1 a named store was not found or could
not be removed (``rm``, ``inspect``), or ``gc --dry-run`` found orphans; 2 usage error.

>>> main(["ls", "--json"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from shmstore import _native
from shmstore._segments import PREFIX, human_size, pid_alive, search_dirs, segment_paths


def _rows() -> list[dict[str, Any]]:
    sup = _native.supervisor_info()
    tracked: dict[str, list[int]] = sup["segments"] if sup else {}
    rows: list[dict[str, Any]] = []
    for path in segment_paths():
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        row: dict[str, Any] = {
            "name": path.name,
            "path": str(path),
            "size": st.st_size,
            "age_s": round(time.time() - st.st_mtime, 1),
            "kind": None,
            "records": None,
            "creator_pid": None,
            "creator_alive": None,
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
            except Exception as e:  # a corrupt or foreign file: still list it
                row["kind"] = f"unreadable ({type(e).__name__})"
        rows.append(row)
    return rows


def _ls(args: argparse.Namespace) -> int:
    rows = _rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no shmstore segments in " + ", ".join(str(d) for d in search_dirs()))
        return 0
    head = (
        f"{'NAME':42} {'SIZE':>10} {'KIND':9} {'RECORDS':>9} {'CREATOR':>12} {'AGE':>7}  ATTACHED"
    )
    print(head)
    for r in rows:
        creator = ""
        if r["creator_pid"] is not None:
            creator = f"{r['creator_pid']}{'' if r['creator_alive'] else ' (dead)'}"
        attached = ",".join(map(str, r["attached_pids"])) or ("-" if r["tracked"] else "?")
        records = "" if r["records"] is None else str(r["records"])
        print(
            f"{r['name']:42} {human_size(r['size']):>10} {r['kind']:9} {records:>9} "
            f"{creator:>12} {r['age_s']:>6.0f}s  {attached}"
        )
    return 0


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = _native._store_info(args.name)
    except FileNotFoundError as e:
        print(f"shmstore: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            shown = human_size(v) if k.endswith("nbytes") else v
            print(f"{k:16} {shown}")
    return 0


def _gc(args: argparse.Namespace) -> int:
    report = _native.sweep(dry_run=args.dry_run)
    orphans = [r for r in report if r["removed"]]
    verb = "would remove" if args.dry_run else "removed"
    for r in report:
        if r["removed"]:
            print(f"{verb} {r['path']} ({human_size(r['size'])})")
        elif args.verbose:
            print(f"kept {r['path']}: used by {r['users']}")
    freed = sum(r["size"] for r in orphans)
    print(f"{verb} {len(orphans)} orphaned segment(s), {human_size(freed)}")
    return 1 if (args.dry_run and orphans) else 0


def _rm(args: argparse.Namespace) -> int:
    status = 0
    for name in args.names:
        full = name if name.startswith(PREFIX) else PREFIX + name
        for d in search_dirs():
            try:
                (d / full).unlink()
                break
            except FileNotFoundError:
                continue
        else:
            print(f"shmstore: no segment named {full!r}", file=sys.stderr)
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shmstore`` console script."""
    p = argparse.ArgumentParser(prog="shmstore", description="Manage shmstore segments.")
    p.add_argument("--version", action="version", version=f"shmstore {_native.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list this user's segments (size, kind, creator, users)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(fn=_ls)
    ins = sub.add_parser("inspect", help="show a store's header (a name, or a saved file's path)")
    ins.add_argument("name")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=_inspect)
    gc = sub.add_parser("gc", help="remove orphaned segments (no live process maps them)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.add_argument("-v", "--verbose", action="store_true", help="also list what is kept")
    gc.set_defaults(fn=_gc)
    rm = sub.add_parser("rm", help="unlink segments by name (mappings in use keep working)")
    rm.add_argument("names", nargs="+")
    rm.set_defaults(fn=_rm)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())
