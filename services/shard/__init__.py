"""The shard service: see handler.py."""
from services.shard.handler import fetch, ready

__all__ = ["fetch", "ready"]
