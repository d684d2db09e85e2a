"""``python -m shmstore``: the ``shmstore`` command (:mod:`shmstore.cli`)."""

from shmstore.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
