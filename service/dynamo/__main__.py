"""`python -m service.dynamo worker|router [flags]` (the `dynamo-worker` / `dynamo-router`
commands of nim-torch), or `python -m service.dynamo local --workers N` (service.dynamo.local)."""

from __future__ import annotations

import sys

from service.cli import main as cli_main
from service.dynamo.local import main as local_main

ROLES = {"worker": "dynamo-worker", "router": "dynamo-router"}


def main(argv: list[str]) -> None:
    if argv and argv[0] == "local":
        sys.exit(local_main(argv[1:]))
    if not argv or argv[0] not in ROLES:
        sys.exit("usage: python -m service.dynamo {worker|router|local} [flags]")
    cli_main([ROLES[argv[0]], *argv[1:]])


if __name__ == "__main__":
    main(sys.argv[1:])
