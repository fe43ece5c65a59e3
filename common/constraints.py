"""Constrained decoding: a grammar the reply must match, as a mask on each sampled row.

A request names what its reply must be (a JSON schema, any JSON object, a tool call of the given
functions: `Grammar`); the compiler the host installed turns it, for the model's tokenizer, into a
`Constraint` per generation, whose allowed(sequence) is the Generation's `allowed` (common/
generation.py): the ids that may follow the prompt and the reply so far, a bool (vocab,). The rows
are masked with it wherever they are sampled (common/sampling.py: Row.masked), the shards'
summaries included, and a draft token outside it is rejected like any draft of probability 0.

Why an installed compiler and not an import: the engine (llguidance, deploy/llguidance_engine.py)
is native code, which Pyodide does not have; where none is installed (the Cloudflare Workers), a
request that needs one gets a 400 that says so. The same pattern as the matmul kernels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

MAX_GRAMMAR_BYTES = 64 << 10  # a schema or a set of tools larger than this is a 400


class ConstraintError(ValueError):
    """The grammar does not compile (a 400 naming the request's field)."""


@dataclass(frozen=True)
class Grammar:
    """What a reply must be. kind: "json_schema" (source: the schema, as JSON text) or "tool_calls"
    (source: the tools' {"name": parameters schema} as JSON text; parallel: one call or more)."""
    kind: str
    source: str
    parallel: bool = False


class Constraint(Protocol):
    def allowed(self, seq: Sequence[int]) -> np.ndarray | None:
        """The ids that may follow seq (the prompt, then the reply so far), bool (vocab,)."""


class Compiled(Protocol):
    def start(self, n_prompt: int) -> Constraint:
        """A fresh constraint for one generation whose prompt is n_prompt ids."""


class Compiler(Protocol):
    name: str

    def compile(self, grammar: Grammar, tokenizer, vocab_size: int) -> Compiled:
        """Raises ConstraintError where the grammar is not one the engine compiles."""


_installed: Compiler | None = None


def install(compiler: Compiler | None) -> None:
    global _installed
    _installed = compiler


def compiler() -> Compiler | None:
    """The host's compiler, or None where it has none (then constrained requests are a 400)."""
    return _installed
