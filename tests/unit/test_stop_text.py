"""Stop strings (common.generation.StopText) against a plain search of the whole text after every
token: the same cut, the same released text at every step, and never a stop string's part sent."""
from __future__ import annotations

import random

import pytest

from common.generation import StopText


class NaiveStop:
    """The oracle: search the whole text for every stop string after each push, and hold back the
    longest tail that is a proper prefix of one."""

    def __init__(self, stop):
        self.stop = [s for s in stop if s]
        self.text, self.emitted, self.stopped = "", 0, False

    def _cut(self):
        hits = [j for s in self.stop if (j := self.text.find(s)) >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True

    def push(self, delta):
        self.text += delta
        self._cut()
        held = 0 if self.stopped else max(
            (n for s in self.stop for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
        return self._release(len(self.text) - held), self.stopped

    def finish(self, tail=""):
        if not self.stopped and tail:
            self.text += tail
            self._cut()
        return self._release(len(self.text))

    def _release(self, upto):
        out = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out


@pytest.mark.parametrize("seed", range(300))
def test_stop_text_matches_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 3 else "abc\n"  # small alphabets: overlaps, repeats and near misses
    stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7))) for _ in range(rng.randint(0, 4))]
    got, want = StopText(stop), NaiveStop(stop)
    sent = ""
    for _ in range(rng.randint(0, 30)):
        delta = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5)))
        g, w = got.push(delta), want.push(delta)
        assert g == w, (stop, got.text)
        sent += g[0]
        assert not any(s and s in sent for s in stop), (stop, sent)
        if g[1]:
            break
    tail = "" if got.stopped else "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
    assert got.finish(tail) == want.finish(tail)
    assert (got.text, got.stopped) == (want.text, want.stopped)


def test_the_earliest_match_wins_within_one_push():
    st = StopText(["bcd", "abcdef"])
    assert st.push("xxabcdefyy") == ("xx", True)  # "abcdef" starts first, though "bcd" ends first
    assert st.text == "xx"
    st = StopText(["\n\n"])
    assert st.push("def f():\n") == ("def f():", False)  # a "\n" that may start the stop string waits
    assert st.push("    pass\n") == ("\n    pass", False)
    assert st.push("\nrest") == ("", True) and st.text == "def f():\n    pass"


def test_a_long_stop_string_is_held_back_and_cut_across_many_tokens():
    st = StopText(["a" * 1000 + "b", "\u0100" + "a" * 1000])
    released = "".join(st.push("aaaa")[0] for _ in range(400))
    assert released == "a" * 600  # the last 1,000 a's may still begin "a...ab"
    assert st.push("aab") == ("aa", True)  # "a" * 1000 + "b" starts 1,000 characters before the b
    assert st.text == "a" * 602
