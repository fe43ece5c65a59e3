"""The coordinator service: see handler.py."""
from services.coordinator.handler import fetch, ready

__all__ = ["fetch", "ready"]
