"""Where a station's tensors come from: its LayerWarden first, R2 when the warden fails.

Seed section 8 traps handled here:
- loadLayerPhase silent skip: a tensor the knot lacks raises MissingTensorError naming the
  phase, the layer and the tensor, before anything runs;
- layer-warden no-invalidate poisoning: a frame the station cannot decode, or one that
  disagrees with the knot header, is dropped from the warden (POST /invalidate/<name>, in
  the background) and the bytes are read from R2 instead.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

import numpy as np

from common import wire
from common.knot import KnotHeader
from common.models import MissingTensorError, Model
from common.quant import QTensor
from common.runtime import HttpError
from services.knot_source import KnotSource
from services.layer_warden.client import LayerWardenClient

log = logging.getLogger(__name__)


class PhaseLoader:
    def __init__(self, model: Model, header: KnotHeader, source: KnotSource, warden: LayerWardenClient | None,
                 wait_until: Callable[[Awaitable[Any]], None]):
        self.model, self.header, self.source, self.warden = model, header, source, warden
        self.wait_until = wait_until
        self.stats = {"warden_tensors": 0, "warden_bytes": 0, "r2_tensors": 0, "r2_bytes": 0,
                      "warden_failures": 0, "invalidations": 0}

    def names(self, layer: int, phase: str) -> list[str]:
        names = self.model.phase_tensors(layer, phase)
        for n in names:
            if n not in self.header.tensors:
                raise MissingTensorError(phase, layer, n)
        return names

    def nbytes(self, name: str) -> int:
        """The tensor's size in the knot, known before it is loaded."""
        return self.header.tensors[name].length

    async def load(self, names: list[str]) -> dict[str, QTensor]:
        """name -> QTensor for every name; warden batch first, R2 for whatever it did not give."""
        got: dict[str, QTensor] = {}
        if self.warden is not None:
            got = await self._from_warden(names)
        missing = [n for n in names if n not in got]
        if missing:
            loaded = await asyncio.gather(*(self._from_r2(n) for n in missing))
            got.update(zip(missing, loaded))
        return got

    def _qtensor(self, name: str, payload: bytes | memoryview) -> QTensor:
        e = self.header.tensors[name]
        return QTensor(name, e.ggml_type, e.shape, np.frombuffer(payload, dtype=np.uint8))

    async def _from_r2(self, name: str) -> QTensor:
        data = await self.source.read(*self.header.tensor_range(name))
        self.stats["r2_tensors"] += 1
        self.stats["r2_bytes"] += len(data)
        return self._qtensor(name, data)

    async def _from_warden(self, names: list[str]) -> dict[str, QTensor]:
        try:
            frames = await self.warden.tensors(names)
        except (HttpError, TimeoutError) as e:
            self.stats["warden_failures"] += 1
            log.warning("layer warden failed, reading %d tensors from R2: %s", len(names), e)
            return {}
        except wire.WireError as e:
            # We cannot tell which entry is bad: drop them all so the next load is clean.
            log.warning("layer warden sent an undecodable batch (%s); invalidating %s", e, names)
            for n in names:
                self._invalidate(n)
            return {}
        out: dict[str, QTensor] = {}
        for name, frame in zip(names, frames):
            problem = self._check(name, frame)
            if problem:
                log.warning("layer warden frame for %s rejected (%s): invalidating, reading R2", name, problem)
                self._invalidate(name)
                continue
            out[name] = self._qtensor(name, frame.payload)
            self.stats["warden_tensors"] += 1
            self.stats["warden_bytes"] += len(frame.payload)
        if len(frames) != len(names):
            log.warning("layer warden sent %d frames for %d names", len(frames), len(names))
        return out

    def _check(self, name: str, frame: wire.TensorFrame) -> str | None:
        e = self.header.tensors[name]
        if frame.name != name:
            return f"frame names {frame.name!r}"
        if frame.ggml_type != e.ggml_type or tuple(frame.shape) != tuple(e.shape):
            return f"{frame.ggml_type} {list(frame.shape)}, the knot says {e.ggml_type} {list(e.shape)}"
        if len(frame.payload) != e.length:
            return f"{len(frame.payload)} bytes, the knot says {e.length}"
        return None

    def _invalidate(self, name: str) -> None:
        self.stats["invalidations"] += 1

        async def run() -> None:
            try:
                await self.warden.invalidate(name)
            except (HttpError, TimeoutError) as e:
                log.warning("invalidate %s failed: %s", name, e)

        self.wait_until(run())
