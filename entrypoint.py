#!/usr/bin/env python3
"""Container entrypoint: `entrypoint.py [serve] [flags]`. Thin by design: all logic is in service.cli."""

from service.cli import main

if __name__ == "__main__":
    main()
