"""Both metadata stores against a model in plain dictionaries, under random sequences of
registrations, heartbeats (delta, gaps, full syncs), expiries and external-KV reports and
revokes, with limits small enough to be hit often: after every step the stores hold exactly
what the model holds, and refuse exactly what it refuses."""

from __future__ import annotations

import itertools
import uuid

import pytest
from _master_harness import redis_server
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mori.umbp._master.memory_store import InMemoryStore
from mori.umbp._master.redis_store import RedisStore
from mori.umbp._master.settings import MasterSettings
from mori.umbp._master.store import (
    ClientRecord,
    HeartbeatStatus,
    KvEvent,
    Limits,
    Location,
    MetadataStore,
    QuotaExceeded,
    TierCapacity,
)

NODES = ["n0", "n1", "n2"]
KEYS = [f"k{i}" for i in range(6)]
HASHES = ["h0", "h1", "h2", "h3"]
TIERS = [1, 2, 3]
LIMITS = Limits(max_clients=2, max_keys=4, max_keys_per_client=3, max_external_kv_per_client=3, max_hit_entries=2)
STALE_MS = 5_000


class Model:
    def __init__(self) -> None:
        self.clients: dict[str, dict] = {}  # node -> {seq, hb}
        self.locs: dict[str, dict[tuple[str, int], int]] = {}  # node -> (key, tier) -> size
        self.ext: dict[str, dict[str, int]] = {}  # node -> hash -> mask
        self.hits: dict[str, int] = {}

    def keys_of(self, node: str, locs: dict[tuple[str, int], int] | None = None) -> set[str]:
        return {k for k, _ in (self.locs.get(node, {}) if locs is None else locs)}

    def all_keys(self, replace: tuple[str, dict] | None = None) -> set[str]:
        out: set[str] = set()
        for node, locs in self.locs.items():
            if replace and node == replace[0]:
                locs = replace[1]
            out |= {k for k, _ in locs}
        return out

    def drop(self, node: str) -> None:
        self.clients.pop(node, None)
        self.locs.pop(node, None)
        self.ext.pop(node, None)

    def register(self, node: str, now: int):
        c = self.clients.get(node)
        if c is not None and now - c["hb"] <= STALE_MS:
            return False
        if c is None and len(self.clients) >= LIMITS.max_clients:
            return "quota"
        self.drop(node)
        self.clients[node] = {"seq": 0, "hb": now}
        self.locs[node] = {}
        return True

    def heartbeat(self, node: str, first: int, last: int, now: int, events: list[KvEvent], full: bool):
        c = self.clients.get(node)
        if c is None:
            return (HeartbeatStatus.UNKNOWN, 0)
        if not full and first != c["seq"] + 1:
            c["hb"] = now
            return (HeartbeatStatus.SEQ_GAP, c["seq"])
        new = {} if full else dict(self.locs[node])
        for e in events:
            if e.add:
                new[(e.key, e.tier)] = e.size
            elif not full:
                new.pop((e.key, e.tier), None)
        count, current = len(self.keys_of(node, new)), len(self.keys_of(node))
        total, current_total = len(self.all_keys((node, new))), len(self.all_keys())
        if (count > LIMITS.max_keys_per_client and count > current) or (
            total > LIMITS.max_keys and total > current_total
        ):
            c["hb"] = now  # refused, but the node is alive
            return "quota"
        self.locs[node] = new
        c.update(seq=last, hb=now)
        return (HeartbeatStatus.APPLIED, last)

    def report(self, node: str, hashes: list[str], tier: int):
        if node not in self.clients:
            return False
        mine = self.ext.setdefault(node, {})
        if len(set(mine) | set(hashes)) > LIMITS.max_external_kv_per_client:
            if not mine:
                del self.ext[node]
            return "quota"
        for h in hashes:
            mine[h] = mine.get(h, 0) | (1 << tier)
        return True

    def revoke(self, node: str, hashes: list[str] | None, mask: int) -> None:
        mine = self.ext.get(node, {})
        for h in list(mine) if hashes is None else hashes:
            if h in mine:
                mine[h] &= ~mask
                if not mine[h]:
                    del mine[h]
        if node in self.ext and not mine:
            del self.ext[node]

    def match(self, hashes: list[str], count: bool) -> dict[str, dict[int, list[str]]]:
        out: dict[str, dict[int, list[str]]] = {}
        for h in dict.fromkeys(hashes):
            holders = [(n, m[h]) for n, m in self.ext.items() if h in m]
            for node, mask in holders:
                for t in TIERS:
                    if mask & (1 << t):
                        out.setdefault(node, {}).setdefault(t, []).append(h)
            if count and holders and (h in self.hits or len(self.hits) < LIMITS.max_hit_entries):
                self.hits[h] = self.hits.get(h, 0) + 1
        return out


def call(fn, *args):
    try:
        return fn(*args)
    except QuotaExceeded:
        return "quota"


kv_event = st.builds(
    KvEvent,
    add=st.booleans(),
    key=st.sampled_from(KEYS),
    tier=st.sampled_from(TIERS),
    size=st.integers(1, 1 << 20),
)
nodes = st.sampled_from(NODES)
register = st.tuples(st.just("register"), nodes)
# Mostly the next sequence number (a gap now and then), so that most heartbeats apply.
delta = st.tuples(st.just("delta"), nodes, st.sampled_from([0, 0, 0, 0, 1]), st.lists(kv_event, min_size=1, max_size=6))
report = st.tuples(
    st.just("report"), nodes, st.lists(st.sampled_from(HASHES), min_size=1, max_size=3), st.sampled_from(TIERS)
)
step = st.one_of(
    register,
    register,
    delta,
    delta,
    delta,
    delta,
    report,
    report,
    st.tuples(st.just("unregister"), nodes),
    st.tuples(st.just("full"), nodes, st.integers(0, 50), st.lists(kv_event, max_size=6)),
    st.tuples(st.just("expire"), st.integers(0, 30_000)),
    st.tuples(
        st.just("revoke"), nodes, st.lists(st.sampled_from(HASHES), min_size=1, max_size=3), st.sampled_from(TIERS)
    ),
    st.tuples(st.just("revoke_tier"), nodes, st.sampled_from(TIERS)),
    st.tuples(st.just("revoke_node"), nodes),
    st.tuples(st.just("match"), st.lists(st.sampled_from(HASHES), min_size=1, max_size=4), st.booleans()),
)


def run(store: MetadataStore, steps: list[tuple]) -> None:
    model = Model()
    clock = itertools.count(1_000_000, 1_000)
    # Two nodes registered to start with (the limit): most steps then act on a live node.
    for op in [("register", "n0"), ("register", "n1"), *steps]:
        now = next(clock)
        kind = op[0]
        if kind == "register":
            record = ClientRecord(op[1], "addr", f"{op[1]}:peer", b"\x00engine", ["a=b"], {2: TierCapacity(10, 5)})
            assert call(store.register_client, record, now, STALE_MS) == model.register(op[1], now), op
        elif kind == "unregister":
            assert store.unregister_client(op[1]) == (op[1] in model.clients)
            model.drop(op[1])
        elif kind in ("delta", "full"):
            node, full = op[1], kind == "full"
            seq = model.clients.get(node, {"seq": 0})["seq"]
            first = op[2] if full else seq + 1 + op[2]
            got = call(store.apply_heartbeat, node, first, first, now, {}, op[3], full)
            want = model.heartbeat(node, first, first, now, op[3], full)
            event(f"heartbeat: {want if want == 'quota' else want[0].name}")
            assert (got if got == "quota" else (got.status, got.acked_seq)) == want, op
        elif kind == "expire":
            cutoff = now - op[1]
            dead = sorted(n for n, c in model.clients.items() if c["hb"] < cutoff)
            for n in dead:
                model.drop(n)
            assert sorted(store.expire_stale_clients(cutoff)) == dead
        elif kind == "report":
            want = model.report(op[1], op[2], op[3])
            event(f"report: {want}")
            assert call(store.report_external_kv, op[1], op[2], op[3]) == want, op
        elif kind == "revoke":
            store.revoke_external_kv(op[1], op[2], op[3])
            model.revoke(op[1], op[2], 1 << op[3])
        elif kind == "revoke_tier":
            store.revoke_external_kv_at_tier(op[1], op[2])
            model.revoke(op[1], None, 1 << op[2])
        elif kind == "revoke_node":
            store.revoke_external_kv_for_node(op[1])
            model.revoke(op[1], None, -1)
        elif kind == "match":
            assert store.match_external_kv(op[1], op[2], now) == model.match(op[1], op[2]), op
        check(store, model)


def check(store: MetadataStore, model: Model) -> None:
    want = [
        {Location(n, t, size) for n, locs in model.locs.items() for (k, t), size in locs.items() if k == key}
        for key in KEYS
    ]
    got = store.lookup(KEYS)
    assert [set(locs) for locs in got] == want and all(len(locs) == len(set(locs)) for locs in got)
    assert store.key_count() == len(model.all_keys())
    for alive in ({"n0"}, {"n1", "n2"}, set(NODES)):
        assert store.exists(KEYS, alive) == [any(key in model.keys_of(n) for n in alive) for key in KEYS]
    assert {r.node_id: r.seq for r in store.list_clients()} == {n: c["seq"] for n, c in model.clients.items()}
    for node in NODES:
        assert store.external_kv_count(node) == len(model.ext.get(node, {}))
    saved_hits = dict(model.hits)
    assert store.match_external_kv(HASHES, False, 0) == model.match(HASHES, False)
    assert model.hits == saved_hits
    assert dict(store.hit_counts(HASHES)) == model.hits


EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@EXAMPLES
@given(steps=st.lists(step, min_size=5, max_size=60))
def test_in_memory_store_matches_the_model(steps):
    run(InMemoryStore(LIMITS), steps)


@pytest.fixture(scope="module")
def redis_uri(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as uri:
        yield uri


@EXAMPLES
@given(steps=st.lists(step, min_size=5, max_size=60))
def test_redis_store_matches_the_model(redis_uri, steps):
    settings_ = MasterSettings(redis_uri=redis_uri, redis_namespace=uuid.uuid4().hex, max_pollers=2)
    store = RedisStore(settings_, LIMITS)
    try:
        run(store, steps)
    finally:
        store.close()
