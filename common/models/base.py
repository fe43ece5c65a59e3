"""What an architecture module provides: a Model subclass bound to one model's hyperparameters.

The layer loop (common/layers.py) asks a Model for the phases of a layer, the tensors each phase
reads, and runs them. The services ask it which tensors stay resident, where the LM head lives and
how much float32 a phase's temporaries take. Nothing outside common/models/ knows a tensor name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Mapping, Protocol, Sequence

import numpy as np

from common.kvcache import KVCache
from common.ops import Ops, installed
from common.quant import QTensor

PhaseWeights = Mapping[str, QTensor]          # GGUF name -> tensor, the tensors one phase reads
Sequences = Sequence[tuple[KVCache, np.ndarray]]  # per sequence in a batch: (its KV cache, positions (T_i,))


class MissingTensorError(KeyError):
    """A phase was run without one of its tensors (seed section 8: never skip silently)."""

    def __init__(self, phase: str, layer: int, tensor: str):
        self.phase, self.layer, self.tensor = phase, layer, tensor
        super().__init__(f"phase {phase} of layer {layer}: missing tensor {tensor}")

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ModelConfig(Protocol):
    """The hyperparameters every service reads; an architecture's config may hold more."""

    n_layer: int
    dim: int
    ffn_dim: int
    n_head: int
    n_kv_head: int
    context_length: int
    vocab_size: int

    @property
    def head_dim(self) -> int: ...


class Model(ABC):
    architecture: ClassVar[str]        # the knot header's "architecture"
    phases: ClassVar[tuple[str, ...]]  # the steps of one layer, in the order they run
    # GGUF names of the tensors outside the layers: llama.cpp writes these for every architecture
    # (an architecture that differs overrides them).
    TOKEN_EMBD: ClassVar[str] = "token_embd.weight"
    OUTPUT_NORM: ClassVar[str] = "output_norm.weight"
    OUTPUT: ClassVar[str] = "output.weight"

    def __init__(self, cfg: ModelConfig, ops: Ops | None = None):
        """ops: what the forward computes with (None: the process's, common.ops.installed())."""
        self.cfg = cfg
        self.ops = ops if ops is not None else installed()

    @classmethod
    @abstractmethod
    def from_hparams(cls, hparams: Mapping, ops: Ops | None = None) -> "Model":
        """From the knot header's hparams (keys as in common/knot.py HPARAM_KEYS); ValueError if inconsistent."""

    # -------------------------------------------------------- tensor names

    @abstractmethod
    def phase_tensors(self, layer: int, phase: str) -> list[str]:
        """The GGUF names of exactly the tensors `phase` of `layer` reads."""

    @abstractmethod
    def is_resident(self, name: str) -> bool:
        """The small tensors (norms, biases) a holder keeps for its whole life instead of streaming them."""

    def layer_tensors(self, layer: int) -> list[str]:
        return [n for p in self.phases for n in self.phase_tensors(layer, p)]

    def head_tensor(self, has_tensor: Callable[[str], bool]) -> str:
        """Tensor of the LM head. There may be no output.weight: then the head is tied to token_embd."""
        return self.OUTPUT if has_tensor(self.OUTPUT) else self.TOKEN_EMBD

    # -------------------------------------------------------- math

    def new_kv(self, dtype=None) -> KVCache:
        """An empty cache; dtype None: the storage type this model's ops read best."""
        return KVCache(self.cfg.n_kv_head, self.cfg.head_dim, dtype=dtype if dtype is not None else self.ops.kv_dtype)

    @abstractmethod
    def activation_bytes(self, T: int, S: int) -> int:
        """Bytes of the float32 temporaries of the largest phase over T new rows attending to S positions."""

    @abstractmethod
    def run_phase(self, layer: int, phase: str, state: Any, w: PhaseWeights, seqs: Sequences) -> Any:
        """One step of the layer loop. The state entering a layer's first phase and leaving its last
        is the hidden state (N, dim) f32 of the sequences' rows back to back; between phases it is
        whatever the architecture carries."""

    @abstractmethod
    def embed(self, tokens: Sequence[int] | np.ndarray, rows: QTensor, vocab_start: int,
              vocab_end: int) -> np.ndarray:
        """tokens (T,) -> (T, dim) f32 from rows [vocab_start, vocab_end) of token_embd; zeros for other tokens."""

    @abstractmethod
    def final_norm(self, h: np.ndarray, norm_w: QTensor) -> np.ndarray:
        """h (T, dim) -> (T, dim), the norm before the LM head."""

    @abstractmethod
    def lm_head(self, h: np.ndarray, rows: QTensor) -> np.ndarray:
        """h (T, dim) final-normed -> logits (T, n_rows) of the rows' vocabulary slice."""
