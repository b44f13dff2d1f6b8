"""Metrics the clients report (``ReportMetrics``), served beside the master's own.

As in MORI, each sample gets ``node=<node_id>`` and the node's ``key=value`` tags as labels;
counters add deltas, gauges are set, histograms merge bucket by bucket. Bounded and checked: a
name must be ``mori_umbp_*`` and not one of the master's own, label names must be Prometheus's,
at most ``max_series`` series are kept, and a node's series leave with it. A report with one bad
sample, or one that would pass the series limit, is refused whole.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from .store import QuotaExceeded

_NAME = re.compile(r"mori_umbp_[a-zA-Z0-9_]{1,120}")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]{0,63}")
MAX_LABELS = 16
MAX_LABEL_VALUE_BYTES = 256
MAX_BUCKETS = 64

Labels = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reported value. ``kind``: counter (``value`` is a delta), gauge, or histogram
    (``bounds``, cumulative ``buckets``, ``count``, ``total``)."""

    kind: str
    name: str
    help: str
    labels: tuple[tuple[str, str], ...]
    value: float = 0.0
    bounds: tuple[float, ...] = ()
    buckets: tuple[int, ...] = ()
    count: int = 0
    total: float = 0.0


@dataclasses.dataclass
class _Series:
    kind: str
    help: str
    value: float = 0.0
    bounds: tuple[float, ...] = ()
    buckets: list[int] = dataclasses.field(default_factory=list)
    count: int = 0
    total: float = 0.0


def _family(kind: str, name: str) -> str:
    """The family name: a counter's without its ``_total``."""
    return name.removesuffix("_total") if kind == "counter" else name


def _stem(name: str) -> str:
    """What a family's sample names start with: one family per stem keeps them apart (a gauge
    ``x_total`` would print the same sample name as a counter ``x``)."""
    for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


class ReportedMetrics(Collector):
    def __init__(self, max_series: int, reserved_families: Iterable[str]) -> None:
        self.max_series = max_series
        self.reserved = {_stem(f) for f in reserved_families}
        self._lock = threading.Lock()
        self._series: dict[tuple[str, Labels], _Series] = {}  # (family, labels) -> series
        self._kinds: dict[str, str] = {}  # family -> kind
        self._stems: dict[str, str] = {}  # stem -> family

    @staticmethod
    def labels_for(node_id: str, tags: Iterable[str], extra: Iterable[tuple[str, str]]) -> Labels:
        """``node``, the node's ``key=value`` tags, then the sample's own labels."""
        out = {"node": node_id}
        for tag in tags:
            key, sep, value = tag.partition("=")
            if sep and _LABEL.fullmatch(key) and key != "node":
                out[key] = value
        for key, value in extra:
            if key == "node":
                raise ValueError("the label 'node' is the master's (the reporting node)")
            out[key] = value
        return tuple(sorted(out.items()))

    def _check(self, i: int, s: Sample) -> str:
        where = f"metrics[{i}] ({s.name!r})"
        if not _NAME.fullmatch(s.name):
            raise ValueError(f"{where}: a reported metric's name must match {_NAME.pattern}")
        family = _family(s.kind, s.name)
        if _stem(family) in self.reserved:
            raise ValueError(f"{where}: the master's own metric")
        other = self._stems.get(_stem(family), family)
        if other != family or self._kinds.get(family, s.kind) != s.kind:
            raise ValueError(f"{where}: reported as a {s.kind}, but {other!r} is a {self._kinds[other]}")
        if len(s.labels) > MAX_LABELS:
            raise ValueError(f"{where}: more than {MAX_LABELS} labels")
        for key, value in s.labels:
            if not _LABEL.fullmatch(key) or key == "le":
                raise ValueError(f"{where}: {key!r} is not a label name")
            if len(value.encode()) > MAX_LABEL_VALUE_BYTES:
                raise ValueError(f"{where}: label {key} is longer than {MAX_LABEL_VALUE_BYTES} bytes")
        if s.kind == "counter" and not (s.value >= 0 and math.isfinite(s.value)):
            raise ValueError(f"{where}: a counter delta must be finite and >= 0, got {s.value}")
        if s.kind == "histogram":
            b = s.buckets
            if len(s.bounds) != len(b) or len(b) > MAX_BUCKETS or list(s.bounds) != sorted(set(s.bounds)):
                raise ValueError(f"{where}: bounds must ascend and match the bucket counts (at most {MAX_BUCKETS})")
            if any(x > y for x, y in zip(b, b[1:])) or (b and b[-1] > s.count):
                raise ValueError(f"{where}: cumulative bucket counts must not fall or exceed count")
            series = self._series.get((family, s.labels))
            if series is not None and series.bounds != s.bounds:
                raise ValueError(f"{where}: bounds differ from the ones first reported")
        return family

    def apply(self, samples: list[Sample]) -> None:
        """Checks every sample, then applies them all; raises ValueError or QuotaExceeded and
        changes nothing when one fails."""
        with self._lock:
            families = [self._check(i, s) for i, s in enumerate(samples)]
            stems: dict[str, str] = {}
            for i, family in enumerate(families):
                if stems.setdefault(_stem(family), family) != family:
                    raise ValueError(f"metrics[{i}] ({samples[i].name!r}): clashes with another sample of the report")
            new = {(f, s.labels) for f, s in zip(families, samples)} - self._series.keys()
            if len(self._series) + len(new) > self.max_series:
                raise QuotaExceeded(
                    f"the report adds {len(new)} series to {len(self._series)}, over the limit of "
                    f"{self.max_series} (UMBP_MASTER_MAX_REPORTED_SERIES)"
                )
            for family, s in zip(families, samples):
                series = self._series.get((family, s.labels))
                if series is None:
                    series = self._series[(family, s.labels)] = _Series(s.kind, s.help[:512] or family)
                    self._kinds[family] = s.kind
                    self._stems[_stem(family)] = family
                if s.kind == "counter":
                    series.value += s.value
                elif s.kind == "gauge":
                    series.value = s.value
                else:
                    if not series.bounds:
                        series.bounds, series.buckets = s.bounds, [0] * len(s.bounds)
                    series.buckets = [a + b for a, b in zip(series.buckets, s.buckets)]
                    series.count += s.count
                    series.total += s.total

    def forget_node(self, node_id: str) -> None:
        with self._lock:
            for key in [k for k in self._series if ("node", node_id) in k[1]]:
                del self._series[key]
            alive = {f for f, _ in self._series}
            self._kinds = {f: k for f, k in self._kinds.items() if f in alive}
            self._stems = {st: f for st, f in self._stems.items() if f in alive}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            items = sorted(self._series.items())
            out: dict[str, Metric] = {}
            for (family, labels), s in items:
                metric = out.get(family)
                if metric is None:
                    metric = out[family] = Metric(family, s.help, s.kind)
                lab = dict(labels)
                if s.kind == "counter":
                    metric.add_sample(family + "_total", lab, s.value)
                elif s.kind == "gauge":
                    metric.add_sample(family, lab, s.value)
                else:
                    for bound, cum in zip(s.bounds, s.buckets):
                        metric.add_sample(family + "_bucket", {**lab, "le": repr(float(bound))}, cum)
                    metric.add_sample(family + "_bucket", {**lab, "le": "+Inf"}, s.count)
                    metric.add_sample(family + "_count", lab, s.count)
                    metric.add_sample(family + "_sum", lab, s.total)
        yield from out.values()
