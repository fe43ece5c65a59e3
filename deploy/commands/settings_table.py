"""knot settings: every environment variable (common/settings.py) as markdown, docs/configuration.md."""
from __future__ import annotations

import sys

from common import settings

NAME = "settings"
HELP = "print the table of environment variables (knot settings > docs/configuration.md)"


def add_arguments(p) -> None:
    pass


def run(args) -> int:
    sys.stdout.write(settings.markdown())
    return 0
