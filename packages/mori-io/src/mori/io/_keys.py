"""Who may claim an engine key on an engine's control plane.

Every engine draws a random secret when it starts (never sent anywhere) and proves its key to a
target with ``proof = HMAC(secret, target key)``: a proof is good at one target only, so a target
that learns it cannot replay it elsewhere. A target binds each key to the proof of the first
engine that claims it (:class:`KeyBindings`) and refuses a claimant with another proof while that
engine lives: while it holds a control connection here, or else while it answers a challenge on
its own control plane (``ping`` with a nonce, answered ``HMAC(proof, nonce)``, which only the
holder of the proof can compute). A bound engine that is gone (restarted, killed) answers neither,
and the key goes to the newcomer. Descriptors carry nothing of this: an ``EngineDesc`` is the same
as MORI's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["Identity", "KeyBindings", "Reach", "challenge_answer", "reach_hosts", "MAX_PROOF", "MAX_NONCE"]

MAX_PROOF = 64  # hex characters of a proof (SHA-256)
MAX_NONCE = 64
_PROOF_LABEL = b"mori-io key proof\x00"


def challenge_answer(proof: str, nonce: str) -> str:
    """What the holder of ``proof`` answers to a liveness challenge with ``nonce``."""
    return hmac.new(proof.encode(), nonce.encode(), hashlib.sha256).hexdigest()


class Identity:
    """An engine's key and its secret (one per engine instance: a restart draws a new one)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._secret = secrets.token_bytes(32)

    def proof_for(self, target_key: str) -> str:
        """The proof of this engine's key at the engine named ``target_key``."""
        return hmac.new(self._secret, _PROOF_LABEL + target_key.encode(), hashlib.sha256).hexdigest()

    def answer(self, prober_key: str, nonce: str) -> str:
        """The answer to a challenge from engine ``prober_key`` (authenticated on the connection
        that carries it): proves that this engine holds its proof at that engine."""
        return challenge_answer(self.proof_for(prober_key), nonce)


@dataclass(frozen=True)
class Reach:
    """Where a claimant's control plane listens: the hosts to try (the one it named, then the
    address its connection came from) and its port."""

    hosts: tuple[str, ...]
    port: int


# Asks the engine at ``reach`` to answer a challenge for ``key``; True when it proves ``proof``.
Probe = Callable[[str, str, Reach], bool]


@dataclass
class _Binding:
    proof: str
    reach: Reach | None
    live: int = 0  # authenticated control connections open now
    probing: threading.Event | None = field(default=None, repr=False)


class KeyBindings:
    """Key -> proof of the engine that holds it, on one control server.

    At most ``max_keys`` bindings are kept; past that the least recently used one whose engine has
    no connection open is dropped (and its key may then be claimed afresh).
    """

    def __init__(self, probe: Probe | None, max_keys: int = 65536) -> None:
        self._probe = probe
        self._max = max_keys
        self._keys: OrderedDict[str, _Binding] = OrderedDict()
        self._lock = threading.Lock()
        self.refused = 0

    def claim(self, key: str, proof: str, reach: Reach | None) -> str | None:
        """Admits a connection claiming ``key`` with ``proof`` (counted live until
        :meth:`release`), or returns why not. A contested key whose holder has no connection
        here is decided by probing the holder (bounded by the probe's own timeout; concurrent
        claimants wait for that one probe), never with the lock held."""
        while True:
            with self._lock:
                b = self._keys.get(key)
                if b is None or hmac.compare_digest(b.proof, proof):
                    self._bind_locked(key, proof, reach, b)
                    return None
                if b.live > 0:
                    return self._refuse_locked(key)
                if b.reach is None or self._probe is None:  # it cannot be asked: gone with its connection
                    self._bind_locked(key, proof, reach, None)
                    return None
                pending = b.probing
                if pending is None:
                    b.probing = mine = threading.Event()
                    bound_proof, bound_reach = b.proof, b.reach
            if pending is not None:  # another claimant asks the holder now: its answer decides
                pending.wait(60.0)
                continue
            alive = False
            try:
                alive = self._probe(key, bound_proof, bound_reach)
            finally:
                with self._lock:
                    b = self._keys.get(key)
                    if b is not None and b.probing is mine:
                        b.probing = None
                        if not alive and b.live == 0:
                            del self._keys[key]  # gone: the next round binds the claimant
                mine.set()
            if alive:
                with self._lock:
                    return self._refuse_locked(key)

    def _refuse_locked(self, key: str) -> str:
        self.refused += 1
        return f"rejected: engine key {key!r} is held by another engine, which is alive"

    def _bind_locked(self, key: str, proof: str, reach: Reach | None, b: _Binding | None) -> None:
        if b is None or not hmac.compare_digest(b.proof, proof):
            b = _Binding(proof, reach)
            self._keys[key] = b
        elif reach is not None:
            b.reach = reach
        b.live += 1
        self._keys.move_to_end(key)
        if len(self._keys) > self._max:
            for old, ob in self._keys.items():
                if ob.live == 0 and ob.probing is None:
                    del self._keys[old]
                    break

    def release(self, key: str, proof: str) -> None:
        """A connection admitted by :meth:`claim` closed."""
        with self._lock:
            b = self._keys.get(key)
            if b is not None and hmac.compare_digest(b.proof, proof) and b.live > 0:
                b.live -= 1

    def __len__(self) -> int:
        return len(self._keys)


def reach_hosts(named: str, peer_address: str) -> Sequence[str]:
    """The hosts to try for a claimant that named ``named`` and connected from ``peer_address``:
    a wildcard or empty name says nothing, and each host is tried once."""
    hosts = [h for h in (named, peer_address) if h and h not in ("0.0.0.0", "::")]
    return tuple(dict.fromkeys(hosts))
