"""The coordinator service: see handler.py."""
from services.coordinator.handler import MAX_BODY_BYTES, PUBLIC, fetch, ready

__all__ = ["MAX_BODY_BYTES", "PUBLIC", "fetch", "ready"]
