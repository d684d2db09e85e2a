"""Command line: ``shmstore ls | inspect NAME | rm NAME`` (also ``python -m shmstore``).

Exit codes: 0 success, 1 the store was not found / not removable, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shmstore import _native
from shmstore._segments import PREFIX, human_size, segment_dir, segment_paths


def _ls(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for path in segment_paths():
        st = path.stat()
        row: dict[str, Any] = {
            "name": path.name,
            "size": st.st_size,
            "age_s": round(time.time() - st.st_mtime, 1),
        }
        if ".part-" in path.name:
            row.update(kind="(building)", creator_pid=None)
        else:
            try:
                info = _native._store_info(path.name)
                row.update(kind=info["kind"], creator_pid=info["creator_pid"], records=info["count"])
            except Exception as e:  # a corrupt or foreign file: still list it
                row.update(kind=f"(unreadable: {type(e).__name__})", creator_pid=None)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no shmstore segments in {segment_dir()}")
        return 0
    print(f"{'NAME':44} {'SIZE':>10} {'KIND':10} {'RECORDS':>9} {'CREATOR':>8} {'AGE':>8}")
    for r in rows:
        print(
            f"{r['name']:44} {human_size(r['size']):>10} {r['kind']:10} "
            f"{r.get('records', ''):>9} {r['creator_pid'] or '':>8} {r['age_s']:>7.0f}s"
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


def _rm(args: argparse.Namespace) -> int:
    status = 0
    for name in args.names:
        full = name if name.startswith(PREFIX) else PREFIX + name
        try:
            (segment_dir() / full).unlink()
        except FileNotFoundError:
            print(f"shmstore: no segment named {full!r} in {segment_dir()}", file=sys.stderr)
            status = 1
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shmstore`` console script."""
    p = argparse.ArgumentParser(prog="shmstore", description="Manage shmstore segments.")
    p.add_argument("--version", action="version", version=f"shmstore {_native.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("ls", help="list this user's segments")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(fn=_ls)
    ins = sub.add_parser("inspect", help="show a store's header (name, or path of a saved file)")
    ins.add_argument("name")
    ins.add_argument("--json", action="store_true")
    ins.set_defaults(fn=_inspect)
    rm = sub.add_parser("rm", help="unlink segments by name (mappings in use keep working)")
    rm.add_argument("names", nargs="+")
    rm.set_defaults(fn=_rm)
    args = p.parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
