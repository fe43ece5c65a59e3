"""Healthcheck probe (the compose healthcheck and the launcher use the same code).

    python -m deploy.local.probe URL [--timeout-s 3]     exit 0 when URL answers 200
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def probe(url: str, timeout_s: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.local.probe")
    p.add_argument("url")
    p.add_argument("--timeout-s", type=float, default=3.0)
    args = p.parse_args(argv)
    return 0 if probe(args.url, args.timeout_s) else 1


if __name__ == "__main__":
    sys.exit(main())
