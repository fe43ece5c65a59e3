"""Where a station's tensors come from: its LayerWarden first, R2 when the warden fails.

Seed section 8 traps handled here:
- loadLayerPhase silent skip: a tensor the knot lacks raises MissingTensorError naming the
  phase, the layer and the tensor, before anything runs;
- layer-warden no-invalidate poisoning: a frame the station cannot decode, or one that
  disagrees with the knot header, is dropped from the warden (POST /invalidate/<name>, in
  the background) and the bytes are read from R2 instead.

Integrity (issue 12): the warden must answer for the station's knot version (X-Knot-Etag, checked
by the client), and each frame's payload crc32 (computed while the frame's own crc32 is checked)
must equal the knot header's crc32 for the tensor; R2 reads are pinned to the version and checked
the same way. A tensor the station keeps between forwards is a copy of checked bytes, read-only and
sealed with the version and its crc32 (sealed_copy / unseal).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import numpy as np

from common import wire
from common.integrity import Seal, crc32
from common.knot import CorruptKnot, KnotHeader
from common.models import MissingTensorError, Model
from common.quant import QTensor, resident_copy
from common.runtime import HttpError
from services.knot_source import KnotSource
from services.layer_warden.layer_warden_client import LayerWardenClient

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealedTensor:
    """A kept tensor: a read-only copy, with the knot version and crc32 it was checked at."""

    seal: Seal
    tensor: QTensor


class PhaseLoader:
    def __init__(self, model: Model, header: KnotHeader, source: KnotSource, warden: LayerWardenClient | None,
                 wait_until: Callable[[Awaitable[Any]], None]):
        self.model, self.header, self.source, self.warden = model, header, source, warden
        self.wait_until = wait_until
        self.stats = {"warden_tensors": 0, "warden_bytes": 0, "r2_tensors": 0, "r2_bytes": 0,
                      "warden_failures": 0, "invalidations": 0, "kept_rejected": 0}
        # (layer, phase) -> its tensor names, checked against the header once: a decode forward
        # asks two or three times per phase, and building and checking them each time was a
        # share of the station's bookkeeping beside its layers (cluster_profile.py --only station)
        self._names: dict[tuple[int, str], tuple[str, ...]] = {}

    def names(self, layer: int, phase: str) -> list[str]:
        names = self._names.get((layer, phase))
        if names is None:
            names = tuple(self.model.phase_tensors(layer, phase))
            for n in names:
                if n not in self.header.tensors:
                    raise MissingTensorError(phase, layer, n)
            self._names[(layer, phase)] = names
        return list(names)

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
        data = await self.source.read_tensor(name)  # pinned to our version, checked against the knot's crc32
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
        try:
            self.header.verify_crc(name, frame.payload_crc32, len(frame.payload))
        except CorruptKnot as err:
            return str(err)
        return None

    def _invalidate(self, name: str) -> None:
        self.stats["invalidations"] += 1

        async def run() -> None:
            try:
                await self.warden.invalidate(name)
            except (HttpError, TimeoutError) as e:
                log.warning("invalidate %s failed: %s", name, e)

        self.wait_until(run())

    def warden_stats(self) -> dict[str, int]:
        """What the warden client counted: replies for another version, bad entries it reported."""
        if self.warden is None:
            return {}
        return {"warden_version_mismatches": self.warden.version_mismatches,
                "warden_rejects_ram": self.warden.rejects["ram"]}

    # -------------------------------------------------------- kept tensors

    def sealed_copy(self, t: QTensor) -> SealedTensor:
        """A read-only copy of t to keep between forwards (a view into a warden batch would pin the
        whole batch buffer), sealed with this station's knot version and the tensor's crc32. Every
        tensor load() returns was checked against the knot's crc32 (the warden frame's payload crc32,
        or the R2 read), so the seal takes that one: a fluid station keeps and evicts hundreds of MB
        per forward, and hashing each copy again cost more than the copy. A knot without checksums
        has nothing to take: the copy is hashed."""
        data = resident_copy(t.data)  # read-only, on huge pages from 4 MiB on
        crc = self.header.tensors[t.name].crc32
        return SealedTensor(Seal(self.source.etag, crc32(data) if crc is None else crc, data.nbytes),
                            QTensor(t.name, t.ggml_type, t.shape, data))

    def unseal(self, kept: SealedTensor) -> QTensor | None:
        """The kept tensor if it is still this station's version and read-only; None (a miss) otherwise.
        Its bytes were checked when loaded; a full check per use would cost a pass over every kept
        byte per forward (53 ms for the 0.5B's first half, 126 MB), more than the forward itself."""
        if kept.seal.etag != self.source.etag or kept.tensor.data.flags.writeable:
            self.stats["kept_rejected"] += 1
            log.warning("kept tensor %s rejected: sealed at version %r, station serves %r", kept.tensor.name,
                        kept.seal.etag, self.source.etag)
            return None
        return kept.tensor
