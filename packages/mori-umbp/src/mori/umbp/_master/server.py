"""The master process: the gRPC service, the reaper, the eviction advisor and the hit-index GC.

``mori-umbp-master ADDRESS [METRICS_PORT]`` (also installed as ``umbp_master``, the name MORI's
launchers find through ``UMBP_MASTER_BIN``) runs :func:`main`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc

try:
    import prometheus_client  # noqa: F401
except ImportError as e:
    raise ImportError("the UMBP master needs its extra: pip install 'mori-umbp[master]'") from e

from mori.core.log import get_logger, set_log_level

from .. import _grpc
from .._signals import StopSignals
from ._proto import umbp_pb2_grpc as pb_grpc
from .eviction import EvictionAdvisor
from .memory_store import InMemoryStore
from .metrics import MasterMetrics
from .router import Router
from .service import MasterService, now_ms
from .settings import MasterSettings
from .store import Limits, MetadataStore, StoreUnavailable

log = get_logger("umbp.master")


def make_store(settings: MasterSettings) -> MetadataStore:
    """The store ``UMBP_METADATA_BACKEND`` names (MORI's ``MakeMasterMetadataStore``)."""
    limits = Limits(
        max_clients=settings.max_clients,
        max_keys=settings.max_keys,
        max_keys_per_client=settings.max_keys_per_client,
        max_external_kv_per_client=settings.max_external_kv_per_client,
        max_hit_entries=settings.max_hit_entries,
    )
    if settings.metadata_backend == "redis":
        try:
            from .redis_store import RedisStore
        except ImportError as e:
            raise ValueError("UMBP_METADATA_BACKEND=redis needs redis-py: pip install 'mori-umbp[redis]'") from e
        return RedisStore(settings, limits)
    return InMemoryStore(limits)


class MasterServer:
    """One master: call :meth:`start`, then :meth:`stop` (or :meth:`wait`)."""

    def __init__(self, settings: MasterSettings) -> None:
        self.settings = settings
        self.store = make_store(settings)
        self.metrics = MasterMetrics(settings.max_reported_series)
        self.router = Router(
            self.store,
            expiry_ms=settings.expiry_s * 1000,
            lease_ms=settings.lease_duration_s * 1000,
            select_algo=settings.route_put_select_algo,
            node_affinity=settings.route_put_node_affinity,
        )
        self.service = MasterService(settings, self.store, self.router, self.metrics)
        self.advisor = EvictionAdvisor(settings, self.store, self.router, self.metrics)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: grpc.Server | _grpc.NativeServer | None = None
        self.port = 0
        self.metrics_port = 0
        self._started_ms = 0

    def start(self) -> None:
        s = self.settings
        self._started_ms = self.router.since_ms = now_ms()
        self.metrics.watch_index(self._index_size)
        if s.metrics_port > 0:
            self.metrics.serve(s.metrics_port)
            self.metrics_port = s.metrics_port
        native = _grpc.native()
        if native is not None:
            try:
                self._server = _grpc.NativeServer(
                    native,
                    s.listen_address,
                    [(pb_grpc.add_UMBPMasterServicer_to_server, self.service)],
                    workers=s.max_pollers,
                    max_message_bytes=s.max_message_bytes,
                    max_streams=s.max_pollers * 4,
                )
            except OSError as e:  # "cannot listen on ADDRESS"
                raise OSError(f"the master {e}") from None
            self.port = self._server.port
        else:
            self._server = self._grpcio_server()
        log.info("[Master] gRPC through %s", _grpc.transport_name())
        for name, period, tick in (
            ("reaper", s.reaper_interval_s, self._reap),
            ("eviction", s.eviction_check_interval_s, self._advise_eviction),
            ("hit-gc", s.hit_index_gc_interval_s, self._gc_hits),
        ):
            t = threading.Thread(target=self._loop, args=(name, period, tick), name=f"umbp-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def _grpcio_server(self) -> grpc.Server:
        s = self.settings
        options = [
            ("grpc.max_receive_message_length", s.max_message_bytes),
            ("grpc.max_send_message_length", s.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=s.max_pollers, thread_name_prefix="umbp-master"),
            options=options,
            maximum_concurrent_rpcs=s.max_pollers * 4,
        )
        pb_grpc.add_UMBPMasterServicer_to_server(self.service, server)
        try:
            self.port = server.add_insecure_port(s.listen_address)
        except RuntimeError as e:
            raise OSError(f"the master cannot listen on {s.listen_address}: {e}") from e
        if self.port == 0:
            raise OSError(f"the master cannot listen on {s.listen_address}")
        server.start()
        return server

    def _index_size(self) -> float:
        try:
            return float(self.store.key_count())
        except StoreUnavailable:
            return float("nan")  # a scrape while the store is down still answers

    def _loop(self, name: str, period_s: float, tick: Callable[[int], None]) -> None:
        while not self._stop.wait(period_s):
            try:
                tick(now_ms())
            except Exception:  # a store hiccup must not end the loop; the next tick retries
                log.exception("[Master] %s tick failed", name)

    def _reap(self, now: int) -> None:
        expiry_ms = self.settings.expiry_s * 1000
        # A master restarted on a persistent store gives every client one full expiry window
        # from its own start: their silence while it was down is the master's, not theirs.
        if now - self._started_ms < expiry_ms:
            return
        for node_id in self.store.expire_stale_clients(now - expiry_ms):
            log.warning("[Reaper] Expired client: %s", node_id)
            self.metrics.expired_clients.inc()
            self.metrics.forget_node(node_id)
            self.advisor.forget(node_id)
        self.metrics.client_count.set(len(self.router.alive_clients(now)))

    def _advise_eviction(self, now: int) -> None:
        advised = self.advisor.run_once(now)
        if advised:
            log.info("[EvictionAdvisor] advised %d keys", advised)

    def _gc_hits(self, now: int) -> None:
        self.store.gc_hits(now - self.settings.hit_index_ttl_s * 1000)

    def stop(self) -> None:
        self._stop.set()
        grace = self.settings.grpc_shutdown_deadline_s
        if isinstance(self._server, _grpc.NativeServer):
            self._server.stop(grace)
        elif self._server is not None:
            self._server.stop(grace).wait(grace + 1)
        self._server = None
        self.advisor.close()  # first: it cancels advice in flight, which the eviction loop may wait on
        for t in self._threads:
            t.join(timeout=self.settings.grpc_shutdown_deadline_s)
        self.store.close()


#: MORI's ``UMBP_LOG_LEVEL`` numbers.
_UMBP_LOG_LEVELS = {"0": "info", "1": "warning", "2": "error"}


def apply_log_level() -> None:
    """MORI's master log settings: ``MORI_UMBP_LOG_LEVEL`` (a name: ``DEBUG``, ``INFO``, ...) or
    ``UMBP_LOG_LEVEL`` (0 info, 1 warning, 2 error); otherwise mori's ``MORI_LOG_LEVEL``."""
    name = os.environ.get("MORI_UMBP_LOG_LEVEL", "").strip().lower()
    if not name:
        name = _UMBP_LOG_LEVELS.get(os.environ.get("UMBP_LOG_LEVEL", "").strip(), "")
    if name:
        try:
            set_log_level(name, module="umbp")
        except ValueError as e:
            log.warning("MORI_UMBP_LOG_LEVEL: %s; keeping the default", e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mori-umbp-master",
        description="The UMBP master: global block index, routing, heartbeats and external-KV index over gRPC. "
        "Settings come from UMBP_* environment variables (see the mori.umbp guide).",
    )
    parser.add_argument(
        "address", nargs="?", help="gRPC listen address host:port (default UMBP_MASTER_LISTEN or 0.0.0.0:50051)"
    )
    parser.add_argument(
        "metrics_port", nargs="?", type=int, help="Prometheus metrics HTTP port (default 9091; 0 = off)"
    )
    ns = parser.parse_args(argv)
    apply_log_level()
    settings = MasterSettings.from_environment()
    if ns.address:
        settings.listen_address = ns.address
    if ns.metrics_port is not None:
        if not 0 <= ns.metrics_port < 65536:
            parser.error(f"METRICS_PORT {ns.metrics_port} is not a port number")
        settings.metrics_port = ns.metrics_port
    log.info("[Master] Resolved timing: %s", settings.describe())
    signals = StopSignals()  # before the line launchers wait for: a SIGTERM after it is caught
    try:
        server = MasterServer(settings)
        server.start()
    except (OSError, ValueError, StoreUnavailable) as e:
        log.error("[Master] cannot start: %s", e)
        return 1
    host = settings.listen_address.rsplit(":", 1)[0]
    # The line launchers and tests wait for: the bound ports (ADDRESS may end in :0).
    print(f"[Master] Listening on {host}:{server.port} metrics_port={server.metrics_port}", flush=True)

    started = time.monotonic()
    log.info("[Master] Caught signal %d, shutting down", signals.wait())
    server.stop()
    log.info("[Master] Exited cleanly after %.1f s", time.monotonic() - started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
