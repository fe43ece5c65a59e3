"""LayerWarden service: a Worker that routes each request to the LayerWarden DO named by its identity.

Stations reach it through a service binding; it reaches the DO class through env.LAYER_WARDEN.
"""
from __future__ import annotations

from common.runtime import Ctx, Env, Request, Response
from services.layer_warden.layer_warden import FIELDS, LayerWarden, resident_rule
from services.warden_base import route_to_warden

DURABLE_OBJECTS = {"LayerWarden": LayerWarden}


async def fetch(request: Request, env: Env, ctx: Ctx) -> Response:
    return await route_to_warden(request, env.LAYER_WARDEN, FIELDS)


__all__ = ["DURABLE_OBJECTS", "LayerWarden", "fetch", "resident_rule"]
