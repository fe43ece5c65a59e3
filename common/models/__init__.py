"""The model registry: the knot header's architecture -> its Model class, one module per architecture.

    model = model_for(header)   # the only way in; UnknownArchitecture names the architectures known
    model.cfg                   # hyperparameters from the header: n_layer, dim, vocab_size, ...
    model.phases, model.phase_tensors(layer, phase), model.is_resident(name), model.head_tensor(...)

Adding an architecture: write common/models/<arch>.py (a Model subclass: config parsing, tensor
names, the resident rule, the phases) and its tests, and list its class in ARCHITECTURES.
"""
from __future__ import annotations

from typing import Mapping, Protocol

from common.models.base import MissingTensorError, Model, ModelConfig, PhaseWeights, Sequences
from common.models.qwen2 import Qwen2
from common.ops import Ops

ARCHITECTURES: dict[str, type[Model]] = {cls.architecture: cls for cls in (Qwen2,)}


class UnknownArchitecture(ValueError):
    """The knot holds a model no module here can run."""


class HasArchitecture(Protocol):
    """A KnotHeader, or a local GGUF's header."""

    @property
    def architecture(self) -> str: ...

    @property
    def hparams(self) -> Mapping: ...


def model_for(header: HasArchitecture, ops: Ops | None = None) -> Model:
    """The header's architecture bound to its hyperparameters, computing with ops (None: the process's,
    common.ops.installed()); UnknownArchitecture, or ValueError for inconsistent hyperparameters."""
    cls = ARCHITECTURES.get(header.architecture)
    if cls is None:
        raise UnknownArchitecture(f"architecture {header.architecture!r} is not supported; the model registry "
                                  f"knows {', '.join(sorted(ARCHITECTURES))} (common/models/)")
    return cls.from_hparams(header.hparams, ops)


__all__ = ["ARCHITECTURES", "MissingTensorError", "Model", "ModelConfig", "PhaseWeights", "Sequences",
           "UnknownArchitecture", "model_for"]
