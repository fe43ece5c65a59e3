"""The drafter service: see handler.py."""
from services.drafter.handler import fetch, ready

__all__ = ["fetch", "ready"]
