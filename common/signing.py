"""Signed internal calls: an HMAC-SHA256 over what a call does and whom it is for, fresh since the
destination's boot.

Every call from one service to another (a station's /forward, a shard's /embed, a warden's
/tensors, /configure, /invalidate, every /stats) carries

    X-Knot-Signature: v2 t=<unix milliseconds>,n=<nonce>,s=<64 hex digits>

where s = HMAC-SHA256(secret, canonical(...)) over these lines, joined by "\\n":

    v2 | METHOD | the path with its query, as sent | the destination service's name |
    the Durable Object's name (or "") | SHA-256 of the body, hex | t | n

A verifier (one per process, named after its service: KNOT_SERVICE_NAME) refuses (401) a call
with no signature, a signature that does not match, one signed for another service (a call to
station-0 replayed to station-1), a timestamp more than REPLAY_WINDOW_S away from its clock, one
signed before the verifier booted (less BOOT_SKEW_S), or a nonce it has already accepted: a
captured call cannot be sent again, elsewhere, or changed. v1 signatures (no destination, whole
seconds) are refused with a message that says so. The secret is the cluster's
(KNOT_INTERNAL_SECRET, generated per cluster: docs/runtime.md "Trust").

Why a per-boot epoch for replays across a restart: the nonces a process accepted are in its
memory and die with it, so a call accepted before a restart would pass again after it. A verifier
instead refuses every call signed before it booted: whatever its previous incarnation accepted was
signed before that one died, which is before this one booted (a restart spawns an interpreter and
imports the service, far longer than BOOT_SKEW_S). This needs no storage, no clock shared beyond
the one the window already assumes, and costs nothing per call. What it rules out: persisting the
nonces (a KV write on every hop's path), per-pair counters (state on both sides that must survive
either's restart), or a window shorter than a restart (a window of well under a second would
refuse an ordinary slow hop). A caller signs every send afresh and in milliseconds, so a call
retried after the destination restarted is signed after its boot and passes.

Pure: the clock, the boot time and the nonce come from the caller (the local host, or the
Cloudflare adapter), so this module imports under Pyodide and both hosts share it.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections import deque

from common.runtime import Unauthorized

SIGNATURE_HEADER = "X-Knot-Signature"
VERSION = "v2"
REPLAY_WINDOW_S = 300.0  # either side of the verifier's clock; a nonce is remembered this long
# How long before its boot a call may be signed and still reach a verifier: a send's own time
# between signing and the socket (a kept-alive connection found stale is sent again at once).
BOOT_SKEW_S = 0.25
MIN_SECRET_CHARS = 32
_HEADER = re.compile(r"v2 t=(?P<t>\d{1,15}),n=(?P<n>[0-9a-f]{16,64}),s=(?P<s>[0-9a-f]{64})")


def canonical(method: str, path: str, to: str, do_name: str, body: bytes, t_ms: int, nonce: str) -> bytes:
    """The bytes a signature covers (path: the request target as sent, query included; to: the
    destination service's name)."""
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join((VERSION, method.upper(), path, to, do_name, digest, str(t_ms), nonce)).encode("utf-8")


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(secret: str, method: str, path: str, body: bytes, now: float, nonce: str, *, to: str,
         do_name: str = "") -> str:
    """The X-Knot-Signature value for one call to the service named `to`. now: unix seconds;
    nonce: fresh random hex (16 to 64 digits)."""
    t_ms = int(now * 1000)
    return f"{VERSION} t={t_ms},n={nonce},s={_mac(secret, canonical(method, path, to, do_name, body, t_ms, nonce))}"


def check_secret(secret: str) -> str:
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"the internal secret has {len(secret)} characters, at least {MIN_SECRET_CHARS} are needed")
    return secret


class Verifier:
    """Checks the signatures of calls to one service (its name: what callers sign as `to`) with one
    secret; remembers the nonces it accepted for the replay window, and refuses calls signed before
    booted_at (unix seconds: when this process began to serve) less boot_skew_s."""

    def __init__(self, secret: str, service: str, *, booted_at: float, window_s: float = REPLAY_WINDOW_S,
                 boot_skew_s: float = BOOT_SKEW_S):
        if not service:
            raise ValueError("a verifier needs its service's name (what callers sign as the destination)")
        self._secret = check_secret(secret)
        self.service, self.booted_at = service, booted_at
        self.window_s, self.boot_skew_s = window_s, boot_skew_s
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()  # (forget at, nonce), in acceptance order
        self.accepted = self.refused = 0

    def verify(self, method: str, path: str, body: bytes, header: str | None, now: float, do_name: str = "") -> None:
        """Returns when the call is signed by the secret for this service, fresh and new; Unauthorized (401)
        otherwise."""
        try:
            self._verify(method, path, body, header, now, do_name)
        except Unauthorized:
            self.refused += 1
            raise
        self.accepted += 1

    def _verify(self, method: str, path: str, body: bytes, header: str | None, now: float, do_name: str) -> None:
        if not header:
            raise Unauthorized(f"{method} {path}: an internal endpoint; the call carries no {SIGNATURE_HEADER}")
        header = header.strip()
        if not header.startswith(VERSION + " "):
            got = header.partition(" ")[0][:8]
            raise Unauthorized(f"{method} {path}: {SIGNATURE_HEADER} version {got!r} is not accepted: this service "
                               f"takes {VERSION} (the destination's name and the time in milliseconds are signed); "
                               f"the caller runs older code than the cluster")
        m = _HEADER.fullmatch(header)
        if m is None:
            raise Unauthorized(f"{method} {path}: {SIGNATURE_HEADER} is malformed (expected "
                               f"'{VERSION} t=<unix ms>,n=<hex nonce>,s=<64 hex digits>')")
        t_ms, nonce = int(m["t"]), m["n"]
        t = t_ms / 1000
        if abs(now - t) > self.window_s:
            raise Unauthorized(f"{method} {path}: signed at t={t:.3f}, {now - t:+.0f} s from this clock "
                               f"(the window is ±{self.window_s:.0f} s)")
        want = _mac(self._secret, canonical(method, path, self.service, do_name, body, t_ms, nonce))
        if not hmac.compare_digest(want, m["s"]):
            raise Unauthorized(f"{method} {path}: the signature does not match (another secret, a call signed for "
                               f"another service than {self.service}, or one changed on the way)")
        if t < self.booted_at - self.boot_skew_s:
            raise Unauthorized(f"{method} {path}: signed {self.booted_at - t:.3f} s before {self.service} started "
                               f"(a call from before its restart, replayed)")
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
