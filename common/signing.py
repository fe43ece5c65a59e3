"""Signed internal calls: an HMAC-SHA256 over what a call does, with a replay window.

Every call from one service to another (a station's /forward, a shard's /embed, a warden's
/tensors, /configure, /invalidate, every /stats) carries

    X-Knot-Signature: v1 t=<unix seconds>,n=<nonce>,s=<64 hex digits>

where s = HMAC-SHA256(secret, canonical(...)) over these lines, joined by "\\n":

    v1 | METHOD | the path with its query, as sent | the Durable Object name (or "") | SHA-256 of the body, hex | t | n

A verifier refuses (401) a call with no signature, a signature that does not match, a timestamp
more than REPLAY_WINDOW_S away from its clock, or a nonce it has already accepted within the
window: a captured call cannot be sent again, nor changed. The secret is the cluster's
(KNOT_INTERNAL_SECRET, generated per cluster: docs/runtime.md "Trust").

Pure: the clock and the nonce come from the caller (the local host, or the Cloudflare adapter),
so this module imports under Pyodide and both hosts share it.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections import deque

from common.runtime import Unauthorized

SIGNATURE_HEADER = "X-Knot-Signature"
VERSION = "v1"
REPLAY_WINDOW_S = 300.0  # either side of the verifier's clock; a nonce is remembered this long
MIN_SECRET_CHARS = 32
_HEADER = re.compile(r"v1 t=(?P<t>\d{1,12}),n=(?P<n>[0-9a-f]{16,64}),s=(?P<s>[0-9a-f]{64})")


def canonical(method: str, path: str, do_name: str, body: bytes, t: int, nonce: str) -> bytes:
    """The bytes a signature covers (path: the request target as sent, query included)."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((VERSION, method.upper(), path, do_name, digest, str(t), nonce)).encode("utf-8")


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, path: str, body: bytes, now: float, nonce: str, do_name: str = "") -> str:
    """The X-Knot-Signature value for one call. nonce: fresh random hex (16 to 64 digits)."""
    t = int(now)
    return f"{VERSION} t={t},n={nonce},s={_mac(secret, canonical(method, path, do_name, body, t, nonce))}"


def check_secret(secret: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the internal secret has {len(secret)} characters, at least {MIN_SECRET_CHARS} are needed")
    return secret


class Verifier:
    """Checks signatures with one secret; remembers the nonces it accepted for the replay window."""

    def __init__(self, secret: str, window_s: float = REPLAY_WINDOW_S):
        self._secret = check_secret(secret)
        self.window_s = window_s
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()  # (forget at, nonce), in acceptance order
        self.accepted = self.refused = 0

    def verify(self, method: str, path: str, body: bytes, header: str | None, now: float, do_name: str = "") -> None:
        """Returns when the call is signed by the secret, fresh and new; Unauthorized (401) otherwise."""
        try:
            self._verify(method, path, body, header, now, do_name)
        except Unauthorized:
            self.refused += 1
            raise
        self.accepted += 1

    def _verify(self, method: str, path: str, body: bytes, header: str | None, now: float, do_name: str) -> None:
        if not header:
            raise Unauthorized(f"{method} {path}: an internal endpoint; the call carries no {SIGNATURE_HEADER}")
        m = _HEADER.fullmatch(header.strip())
        if m is None:
            raise Unauthorized(f"{method} {path}: {SIGNATURE_HEADER} is malformed (expected "
                               f"'v1 t=<seconds>,n=<hex nonce>,s=<64 hex digits>')")
        t, nonce = int(m["t"]), m["n"]
        if abs(now - t) > self.window_s:
            raise Unauthorized(f"{method} {path}: signed at t={t}, {now - t:+.0f} s from this clock "
                               f"(the window is ±{self.window_s:.0f} s)")
        want = _mac(self._secret, canonical(method, path, do_name, body, t, nonce))
        if not hmac.compare_digest(want, m["s"]):
            raise Unauthorized(f"{method} {path}: the signature does not match (another secret, or the call "
                               f"was changed on the way)")
        self._forget(now)
        if nonce in self._seen:
            raise Unauthorized(f"{method} {path}: nonce {nonce} was already used (a replayed call)")
        self._seen.add(nonce)
        self._expiry.append((max(now, t) + 2 * self.window_s, nonce))

    def _forget(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(self._expiry.popleft()[1])

    def stats(self) -> dict[str, int]:
        return {"accepted": self.accepted, "refused": self.refused, "nonces": len(self._seen)}
