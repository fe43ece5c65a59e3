"""CobordismWarden service: hosts the CobordismWarden DO class.

Shards reach the DO through a Durable Object namespace binding (env.COBORDISM_WARDEN); this
Worker's fetch also routes by identity headers, for callers that only have a service binding.
"""
from __future__ import annotations

from common.runtime import Ctx, Env, Request, Response
from services.cobordism_warden.cobordism_warden import FIELDS, CobordismWarden, contiguous_runs
from services.warden_base import route_to_warden

DURABLE_OBJECTS = {"CobordismWarden": CobordismWarden}


async def fetch(request: Request, env: Env, ctx: Ctx) -> Response:
    return await route_to_warden(request, env.COBORDISM_WARDEN, FIELDS)


__all__ = ["DURABLE_OBJECTS", "CobordismWarden", "FIELDS", "contiguous_runs", "fetch"]
