"""The station service: see handler.py."""
from services.station.handler import fetch, ready

__all__ = ["fetch", "ready"]
