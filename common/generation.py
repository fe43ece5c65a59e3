"""Pure pieces of a generation loop shared by the single-process engine and the coordinator:
stop strings with hold-back for streaming, and the per-request generation record."""
from __future__ import annotations

from typing import Sequence


class StopText:
    """Accumulates generated text; releases only what is final.

    Text that could still become the start of a stop string is held back, so a stream never
    shows a stop string (or half of one). push() returns (released text, stopped).
    """

    def __init__(self, stop: Sequence[str] = ()):
        self.stop = [s for s in stop if s]
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, delta: str) -> tuple[str, bool]:
        assert not self.stopped, "push after a stop string"
        self.text += delta
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._release(len(self.text)), True
        return self._release(len(self.text) - self._partial_stop_len()), False

    def finish(self, tail: str = "") -> str:
        """The end: release everything held back (plus a detokenizer's flushed tail)."""
        if not self.stopped and tail:
            self.text += tail
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                self.stopped = True
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out

    def _find_stop(self) -> int | None:
        # Released text held no stop string nor the start of one, so search from a bit before it.
        start = max(0, self.emitted - max((len(s) for s in self.stop), default=0))
        hits = [j for s in self.stop if (j := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
