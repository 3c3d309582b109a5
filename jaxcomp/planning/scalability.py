"""Scalability model of data-parallel training with and without compression (ldte_bs §4.4).

The ldte_bs paper (§4.4, Figs. 7-8) predicts the throughput of ``j`` nodes
of ``i`` GPUs from a single-GPU batch time and an analytic communication
model. This module implements that model for dense SGD and for residual
gradient compression with exact top-k (the paper's "naive RGC": RGC whose
selection is radixSelect), DGC's hierarchical selection and LDTE-BS, plus
exchanges jaxcomp offers beyond the paper (parameter server,
:func:`jaxcomp.comm.server_mean`).

One iteration on every GPU (weak scaling: each GPU trains ``batch_size``
samples, the global batch is ``i * j * batch_size``)::

    T_iter     = T_B + T_s + T_comm          (overlap=True: max(T_B + T_s, T_comm))
    throughput = i * j * batch_size / T_iter
    speedup    = throughput / throughput of dense SGD on one GPU  (= i j T_B / T_iter)

Communication is hierarchical, as the paper models it: first among the
``i`` GPUs of a node (bandwidth ``C_gwd``, latency ``intra_latency``), then
among the ``j`` nodes (``C_nwd``, ``C_ncost``), with inter-node traffic
optionally staged through host memory (``C_cwd``, ``host_bandwidth``)::

    ring all-reduce of B bytes on p peers:  2 (p-1)/p * B / bw + 2 (p-1) * lat
    ring all-gather of B bytes each:        (p-1) * B / bw + (p-1) * lat
    parameter server (full-duplex links):   max(in, out) / bw + 2 * lat,
        in = (p-1) * push, out = (p-1) * pull  (:func:`jaxcomp.comm.server_link_bytes`)

    dense SGD:  all-reduce(g) within the node, then all-reduce(g) across nodes
    sparse:     all-gather(m) within the node, then all-gather(i * m) across nodes
                (each node forwards its GPUs' messages; nothing is merged)

where ``g`` is the dense gradient's bytes and ``m`` one GPU's sparse
message. The inter-node bandwidth is the node's: its ``i`` GPUs share it
(the ``i * m`` above). Beyond the paper, two exchanges on a
``("node", "local")`` mesh (``L = i`` GPUs per node, ``j`` nodes)::

    dense, flat ring (exchange="flat_ring"): one ring of i j GPUs, every step
        as slow as its slowest hop: all-reduce(g) on i j peers at
        min(C_gwd, C_nwd), max(intra_latency, C_ncost) per step
    two-level compressed (exchange="two_level"):
        1. reduce-scatter(g) within the node: each GPU owns its node's sum
           of 1/L of the gradient, (L-1)/L * g bytes, L-1 latencies;
        2. compress that shard (compression time x 1/L), all-gather its
           message m_s (~ m / L) across nodes: every GPU of the node does
           so at once on the shared link, (j-1) * L * m_s / C_nwd
           + (j-1) * C_ncost;
        3. all-gather(g / L) within the node: (L-1)/L * g, L-1 latencies.

The default dense exchange is already NCCL's two-level one: reduce-scatter
within the node, all-reduce of ``g / L`` across nodes by each of the ``L``
GPUs on the shared link (``2 (j-1)/j * g / C_nwd`` in all), all-gather within
the node cost exactly the intra then inter all-reduce above.
The paper's text lost its formulas; two choices were needed:

* **How sparse messages travel.** The sum of ``N`` different top-k sets is
  not k-sparse, so a sparse message cannot be ring all-reduced at its own
  size; jaxcomp all-gathers it (:func:`jaxcomp.comm.sparse_mean`): each
  worker receives ``N - 1`` messages, and the cost grows with ``N``
  (``sparse_exchange="allgather"``, the default). The paper's Figs. 7-8
  behave as if the all-reduce formula were applied to the compressed size
  (LDTE-BS 20.73x over dense at 32 nodes is out of reach once the sparse
  traffic grows with ``N``); that optimistic reading is
  ``sparse_exchange="allreduce"``.
* **Message size.** The paper run-length codes the sparse set (a zero run
  as 16 bits, a value as 32 bits): :func:`rle_message_bytes`, the exact
  size of :func:`jaxcomp.coding.encode_sparse`'s ``"rle"`` format when the
  zeros sit in one run and an upper bound otherwise. ``message="pairs"``
  is what jaxcomp's all-gather moves: ``capacity`` (int32 index, value)
  pairs.

Not modelled: decoding and accumulating the received messages (fold it into
``compression_time`` if it matters), contention between a node's GPUs on
its PCIe switch, stragglers.

Example (one node of two GPUs, 1 GB/s between them, no latency; a 1M-element
float32 gradient; 0.1 s per batch):

>>> from jaxcomp.planning import scalability as sc
>>> cluster = sc.Cluster(nodes=1, gpus_per_node=2, intra_bandwidth=1e9)
>>> work = sc.Workload(batch_time=0.1, gradient_elements=10**6, batch_size=32)
>>> sc.iteration_time(sc.dense_sgd(), cluster, work).communication  # 2 * 1/2 * 4 MB / 1 GB/s
0.004
>>> round(sc.speedup(sc.dense_sgd(), cluster, work), 4)  # 2 * 0.1 / 0.104
1.9231
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from jaxcomp import _validation as V
from jaxcomp.comm.collectives import server_link_bytes
from jaxcomp.selection.selectors import target_count

__all__ = [
    "ALGORITHMS",
    "EXCHANGE_CHOICES",
    "MESSAGE_FORMATS",
    "SPARSE_EXCHANGES",
    "Cluster",
    "ExchangeDecision",
    "IterationTime",
    "Method",
    "Workload",
    "DENSE_EXCHANGES",
    "allgather_time",
    "allreduce_time",
    "compression_pays",
    "dense_sgd",
    "dgc",
    "gbps",
    "iteration_time",
    "ldte_bs",
    "naive_rgc",
    "reduce_scatter_time",
    "rle_message_bytes",
    "server_time",
    "sparse_message_bytes",
    "speedup",
    "throughput",
    "top_k",
]

# How a sparse method's messages travel (``Method.exchange``).
SPARSE_EXCHANGES = ("allgather", "allreduce", "server", "two_level")
# How dense SGD's gradient travels (``Method.exchange``).
DENSE_EXCHANGES = ("allreduce", "server", "flat_ring")
# Wire format of a sparse message (``Method.message``).
MESSAGE_FORMATS = ("rle", "pairs")
# What :func:`compression_pays` chooses between; names as in ``jaxcomp.comm.EXCHANGES``.
EXCHANGE_CHOICES = ("dense", "sparse", "server")

_RUN_MAX = 0xFFFF  # one full 16-bit rle token: 65535 zeros, no value
_INDEX_ITEMSIZE = 4


def gbps(gigabits_per_second: float) -> float:
    """Bytes per second of a link of ``gigabits_per_second`` (1 Gbps = 1.25e8 B/s).

    Example:
      >>> gbps(1), gbps(10)
      (125000000.0, 1250000000.0)
    """
    return V.check_real("gigabits_per_second", gigabits_per_second, 0, low_open=True) * 1e9 / 8


def _positive(name, v):
    return V.check_real(name, v, 0, low_open=True)


def _nonneg(name, v):
    return V.check_real(name, v, 0)


# ---------------------------------------------------------------------------
# Inputs.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``gpus_per_node`` GPUs (the paper's ``j`` and ``i``).

    Bandwidths are in bytes per second (:func:`gbps` converts), latencies in
    seconds per message.

    Attributes:
      nodes: ``j`` >= 1.
      gpus_per_node: ``i`` >= 1.
      intra_bandwidth: GPU-GPU bandwidth inside a node (``C_gwd``, e.g. PCIe).
      intra_latency: per-message latency inside a node.
      inter_bandwidth: network bandwidth between nodes (``C_nwd``): a node's
        link, shared by its GPUs when they use it at once.
      inter_latency: network latency between nodes (``C_ncost``).
      host_bandwidth: CPU-GPU bandwidth (``C_cwd``) when inter-node traffic is
        staged through host memory (no GPUDirect RDMA): every inter-node byte
        also crosses it once, not overlapped (an upper bound). None: no
        staging.

    Example:
      >>> Cluster(nodes=4, gpus_per_node=4).workers
      16
      >>> Cluster(nodes=0)
      Traceback (most recent call last):
      ...
      ValueError: nodes must be an integer >= 1, got 0
    """

    nodes: int = 1
    gpus_per_node: int = 1
    intra_bandwidth: float = 1e10
    intra_latency: float = 0.0
    inter_bandwidth: float = 1.25e9
    inter_latency: float = 0.0
    host_bandwidth: float | None = None

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("intra_bandwidth", "inter_bandwidth"):
            object.__setattr__(self, name, _positive(name, getattr(self, name)))
        for name in ("intra_latency", "inter_latency"):
            object.__setattr__(self, name, _nonneg(name, getattr(self, name)))
        if self.host_bandwidth is not None:
            object.__setattr__(
                self, "host_bandwidth", _positive("host_bandwidth", self.host_bandwidth)
            )

    @property
    def workers(self) -> int:
        """``i * j``, the data-parallel workers."""
        return self.nodes * self.gpus_per_node

    def _inter_seconds_per_byte(self) -> float:
        staged = 0.0 if self.host_bandwidth is None else 1.0 / self.host_bandwidth
        return 1.0 / self.inter_bandwidth + staged


def _check_buckets(value) -> tuple[int, ...]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(
            "gradient_elements must be an element count or a non-empty sequence of "
            f"bucket element counts, got {value!r}"
        )
    out = []
    for i, n in enumerate(value):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"gradient_elements[{i}] must be an integer >= 1, got {n!r}")
        out.append(int(n))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Workload:
    """One GPU's share of an iteration.

    Attributes:
      batch_time: seconds of forward + backward of ``batch_size`` samples on
        one GPU (the paper's ``T_B``).
      gradient_elements: the gradient's element count, or a sequence of
        per-bucket counts (layers or fused buckets: each is selected and
        coded on its own, ``k = ceil(ratio * n)`` per bucket).
      batch_size: samples per GPU per iteration (``B``).
      itemsize: bytes per gradient value (4 for float32).

    Example:
      >>> Workload(batch_time=0.5, gradient_elements=[3, 4]).elements
      7
    """

    batch_time: float
    gradient_elements: int | tuple[int, ...]
    batch_size: int = 1
    itemsize: int = 4

    def __post_init__(self):
        object.__setattr__(self, "batch_time", _nonneg("batch_time", self.batch_time))
        object.__setattr__(self, "gradient_elements", _check_buckets(self.gradient_elements))
        object.__setattr__(self, "batch_size", V.check_int("batch_size", self.batch_size, 1))
        object.__setattr__(self, "itemsize", V.check_int("itemsize", self.itemsize, 1))

    @property
    def buckets(self) -> tuple[int, ...]:
        """Element count of each bucket."""
        return self.gradient_elements

    @property
    def elements(self) -> int:
        """Total gradient elements."""
        return sum(self.gradient_elements)

    @property
    def nbytes(self) -> int:
        """Bytes of the dense gradient (the paper's ``g``)."""
        return self.elements * self.itemsize


CompressionTime = float | Callable[[int], float]


@dataclasses.dataclass(frozen=True)
class Method:
    """A training method: dense SGD (``ratio=None``) or a sparsifier.

    Attributes:
      name: label for tables and plots.
      ratio: compression ratio ``eta`` in (0, 1] (``k = ceil(eta n)`` per
        bucket); None for dense SGD.
      compression_time: seconds one GPU spends selecting/compressing per
        iteration (a number), or a callable of a bucket's element count
        summed over buckets (e.g. :func:`jaxcomp.planning.fit_sparsify_cost`'s
        fit of measured times, or :func:`jaxcomp.planning.linear_cost`).
        With ``exchange="two_level"`` a GPU compresses only its shard
        (``ceil(n / i)`` elements of each bucket): the callable is summed
        over the shards, a number scaled by the shard's share of elements.
      fill: elements sent per bucket over ``k`` (LDTE-BS sends ``nnz`` in
        ``[k, 1.5 k]``; 1.0 models exactly ``k``, as the paper's figures do).
      exchange: one of :data:`DENSE_EXCHANGES` for dense SGD:
        ``"allreduce"`` (default; hierarchical, the cost of NCCL's two-level
        all-reduce), ``"server"`` or ``"flat_ring"`` (one ring of every
        GPU); one of :data:`SPARSE_EXCHANGES` for a sparsifier:
        ``"allgather"`` (default), ``"allreduce"`` (the paper's formula on
        the compressed size), ``"server"`` (sparse push, dense pull, as
        :func:`jaxcomp.comm.server_sparse_mean`) or ``"two_level"``
        (dense reduce-scatter within the node, each GPU compresses its
        ``1/i`` shard and all-gathers it across nodes, dense all-gather
        within the node; see the module docstring).
      message: ``"rle"`` (the paper's run-length format,
        :func:`rle_message_bytes`) or ``"pairs"`` (int32 index + value, what
        jaxcomp's all-gather moves).

    Example:
      >>> m = Method("my_topk", ratio=0.01, message="pairs")
      >>> m.sparse, m.exchange
      (True, 'allgather')
      >>> sparse_message_bytes(m, Workload(1.0, 10**4))  # 100 (int32, float32) pairs
      800.0
    """

    name: str
    ratio: float | None = None
    compression_time: CompressionTime = 0.0
    fill: float = 1.0
    exchange: str | None = None
    message: str = "rle"

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        if self.ratio is not None:
            object.__setattr__(self, "ratio", V.check_ratio("ratio", self.ratio))
        if not callable(self.compression_time):
            object.__setattr__(
                self, "compression_time", _nonneg("compression_time", self.compression_time)
            )
        object.__setattr__(self, "fill", V.check_real("fill", self.fill, 0, low_open=True))
        choices = DENSE_EXCHANGES if self.ratio is None else SPARSE_EXCHANGES
        if self.exchange is None:
            object.__setattr__(self, "exchange", choices[0])
        object.__setattr__(self, "exchange", V.check_choice("exchange", self.exchange, choices))
        object.__setattr__(
            self, "message", V.check_choice("message", self.message, MESSAGE_FORMATS)
        )

    @property
    def sparse(self) -> bool:
        """Whether the method sends a sparse message."""
        return self.ratio is not None


def dense_sgd(exchange: str = "allreduce", name: str | None = None) -> Method:
    """Uncompressed data-parallel SGD (ring all-reduce, or ``exchange="server"``).

    Example:
      >>> dense_sgd().ratio, dense_sgd().exchange, dense_sgd("server").name
      (None, 'allreduce', 'dense_server')
    """
    return Method(
        name or ("dense_sgd" if exchange == "allreduce" else "dense_server"),
        None,
        0.0,
        exchange=exchange,
    )


def top_k(ratio: float = 1e-3, compression_time: CompressionTime = 0.0, **kw) -> Method:
    """RGC with exact top-k selection (``lax.top_k``; radixSelect on the paper's GPUs).

    Example:
      >>> cluster = Cluster(nodes=1, gpus_per_node=2, intra_bandwidth=1e9)
      >>> work = Workload(batch_time=0.1, gradient_elements=10**6)
      >>> t = iteration_time(top_k(1e-3, compression_time=0.01, message="pairs"), cluster, work)
      >>> t.compression, t.communication  # 1000 pairs of 8 bytes to 1 peer at 1 GB/s
      (0.01, 8e-06)
    """
    return Method(kw.pop("name", "top_k"), ratio, compression_time, **kw)


def naive_rgc(ratio: float = 1e-3, compression_time: CompressionTime = 0.0, **kw) -> Method:
    """The paper's "naive RGC": RGC whose top-k selection is radixSelect (exact top-k).

    §4.4 lists the three sparse methods as radixSelect, hierarchical
    selection and LDTE-BS, then compares LDTE-BS with "naive RGC and DGC":
    naive RGC is exact top-k selection, the same model as :func:`top_k` under
    the paper's name.

    Example:
      >>> m = naive_rgc(1e-3)
      >>> m.name, m.ratio
      ('naive_rgc', 0.001)
    """
    return Method(kw.pop("name", "naive_rgc"), ratio, compression_time, **kw)


def dgc(ratio: float = 1e-3, compression_time: CompressionTime = 0.0, **kw) -> Method:
    """RGC with DGC's hierarchical (sampled) selection.

    Example:
      >>> m = dgc(0.01)
      >>> m.name, m.ratio, m.exchange
      ('dgc', 0.01, 'allgather')
    """
    return Method(kw.pop("name", "dgc"), ratio, compression_time, **kw)


def ldte_bs(ratio: float = 1e-3, compression_time: CompressionTime = 0.0, **kw) -> Method:
    """RGC with LDTE-BS selection (``nnz`` in ``[k, 1.5 k]``; ``fill`` says where).

    Example:
      >>> m = ldte_bs(1e-3, fill=1.5)  # LDTE-BS's worst case: 1.5 k sent per bucket
      >>> m.name, m.fill
      ('ldte_bs', 1.5)
    """
    return Method(kw.pop("name", "ldte_bs"), ratio, compression_time, **kw)


# ---------------------------------------------------------------------------
# Message sizes and collective times.
# ---------------------------------------------------------------------------


def rle_message_bytes(k: int, n: int) -> int:
    """Bytes of the run-length-coded message of ``k`` values among ``n`` elements.

    :func:`jaxcomp.coding.encode_sparse`'s ``"rle"`` format: a 32-bit count,
    then per value its zero run as 16-bit tokens and its 32 bits (zeros after
    the last value are implicit). A run ``r`` takes ``r // 65535 + 1``
    tokens, and the runs sum to at most ``n - k``, so for ``k >= 1`` the
    message is at most ``4 + 6 k + 2 * ((n - k) // 65535)`` bytes: exact
    when the zeros sit in one run before the values, at most
    ``2 (n - k) / 65535`` bytes over otherwise (0.003% of the dense size).
    ``k = 0`` is the 4-byte count alone.

    Example:
      >>> import numpy as np
      >>> from jaxcomp import coding
      >>> rle_message_bytes(1000, 10**6)  # 4 + 6000 + 2 * 15
      6034
      >>> idx, val = np.arange(10**6 - 1000, 10**6), np.ones(1000, np.float32)
      >>> len(coding.encode_sparse(idx, val, 10**6))
      6034
    """
    n = V.check_int("n", n, 0)
    k = V.check_int("k", k, 0, n)
    return 4 + 6 * k + 2 * ((n - k) // _RUN_MAX) if k else 4


def sparse_message_bytes(method: Method, workload: Workload) -> float:
    """Bytes of one GPU's sparse message for ``workload`` (summed over buckets).

    Example:
      >>> sparse_message_bytes(ldte_bs(1e-3), Workload(1.0, 10**6))
      6034.0
      >>> sparse_message_bytes(ldte_bs(1e-3, message="pairs"), Workload(1.0, 10**6))
      8000.0
    """
    if not method.sparse:
        raise ValueError(f"method {method.name!r} is dense: it sends no sparse message")
    total = 0.0
    for n in workload.buckets:
        k = min(n, math.ceil(method.fill * target_count(method.ratio, n)))
        if method.message == "rle":
            total += rle_message_bytes(k, n)
        else:
            total += k * (_INDEX_ITEMSIZE + workload.itemsize)
    return float(total)


def _peers(name, p):
    return V.check_int(name, p, 1)


# Collective algorithms of the cost model: the ring (bandwidth-optimal, the
# papers' model) and the recursive halving/doubling ones (latency-optimal:
# ceil(log2 p) rounds, the same bytes), which MPI and NCCL use for small messages.
ALGORITHMS = ("ring", "doubling")


def _rounds(p: int, algorithm: str) -> int:
    algorithm = V.check_choice("algorithm", algorithm, ALGORITHMS)
    return p - 1 if algorithm == "ring" else math.ceil(math.log2(p))


def allreduce_time(
    peers: int, nbytes: float, bandwidth: float, latency: float = 0.0, algorithm: str = "ring"
) -> float:
    """All-reduce: ``2 (p-1)/p * nbytes / bandwidth + 2 R * latency`` (0 for p=1).

    ``R`` is the rounds of each half: ``p - 1`` for the ring,
    ``ceil(log2 p)`` for recursive halving then doubling (Rabenseifner's).

    Example:
      >>> allreduce_time(2, 1e6, 1e9, 1e-5)  # 1 MB over 1 GB/s: 1 ms, plus 2 latencies
      0.00102
      >>> round(allreduce_time(64, 0, 1e9, 1e-5, algorithm="doubling"), 6)  # 2 x 6 rounds
      0.00012
    """
    p = _peers("peers", peers)
    nbytes, bandwidth = _nonneg("nbytes", nbytes), _positive("bandwidth", bandwidth)
    latency = _nonneg("latency", latency)
    return 2.0 * (p - 1) / p * nbytes / bandwidth + 2.0 * _rounds(p, algorithm) * latency


def reduce_scatter_time(
    peers: int, nbytes: float, bandwidth: float, latency: float = 0.0, algorithm: str = "ring"
) -> float:
    """Reduce-scatter of ``nbytes`` (the whole buffer): ``(p-1)/p * nbytes / bw + R * latency``.

    Each peer ends with the sum of its ``1/p`` of the buffer: half an
    all-reduce (``R`` as in :func:`allreduce_time`).

    Example:
      >>> reduce_scatter_time(4, 4e6, 1e9, 1e-5)  # 3/4 * 4 MB / 1 GB/s + 3 latencies
      0.00303
    """
    p = _peers("peers", peers)
    nbytes, bandwidth = _nonneg("nbytes", nbytes), _positive("bandwidth", bandwidth)
    latency = _nonneg("latency", latency)
    return (p - 1) / p * nbytes / bandwidth + _rounds(p, algorithm) * latency


def allgather_time(
    peers: int, nbytes: float, bandwidth: float, latency: float = 0.0, algorithm: str = "ring"
) -> float:
    """All-gather of ``nbytes`` per peer: ``(p-1) * nbytes / bandwidth + R * latency``.

    ``R``: ``p - 1`` rounds for the ring, ``ceil(log2 p)`` for recursive doubling.

    Example:
      >>> allgather_time(3, 1e6, 1e9)
      0.002
    """
    p = _peers("peers", peers)
    nbytes, bandwidth = _nonneg("nbytes", nbytes), _positive("bandwidth", bandwidth)
    latency = _nonneg("latency", latency)
    return (p - 1) * nbytes / bandwidth + _rounds(p, algorithm) * latency


def server_time(
    peers: int, push_nbytes: float, pull_nbytes: float, bandwidth: float, latency: float = 0.0
) -> float:
    """Parameter server on ``peers`` workers (server co-located with one of them).

    The server's link is the bottleneck (:func:`jaxcomp.comm.server_link_bytes`):
    ``(p-1)`` pushes in and ``(p-1)`` pulls out; links are full duplex, so
    ``max(in, out) / bandwidth + 2 * latency`` (push, then pull).

    Example:
      >>> server_time(3, 1e6, 1e6, 1e9)  # 2 MB in, 2 MB out, concurrently
      0.002
    """
    p = _peers("peers", peers)
    _positive("bandwidth", bandwidth)
    link = server_link_bytes(
        _nonneg("push_nbytes", push_nbytes), _nonneg("pull_nbytes", pull_nbytes), p
    )
    if p == 1:
        return 0.0
    return max(link["server_in"], link["server_out"]) / bandwidth + 2.0 * _nonneg(
        "latency", latency
    )


# ---------------------------------------------------------------------------
# Predictions.
# ---------------------------------------------------------------------------


class IterationTime(NamedTuple):
    """Seconds of one iteration on every GPU.

    Attributes:
      compute: forward + backward (``T_B``).
      compression: selection / coding (0 for dense SGD).
      communication: exchanging the gradient (intra + inter node).
      total: ``compute + compression + communication``, or with overlap
        ``max(compute + compression, communication)``.

    Example:
      >>> cluster = Cluster(nodes=1, gpus_per_node=2, intra_bandwidth=1e9)
      >>> work = Workload(batch_time=0.1, gradient_elements=10**6)
      >>> t = iteration_time(dense_sgd(), cluster, work)
      >>> t.compute, t.compression, t.communication  # 2 * 1/2 * 4 MB / 1 GB/s
      (0.1, 0.0, 0.004)
    """

    compute: float
    compression: float
    communication: float
    total: float


def _shards(workload: Workload, parts: int) -> Workload:
    """One GPU's shard after a reduce-scatter over ``parts``: ``ceil(n / parts)`` per bucket."""
    buckets = tuple(-(-n // parts) for n in workload.buckets)
    return dataclasses.replace(workload, gradient_elements=buckets)


def _local_phases_time(
    parts: int, shard_bytes: float, bandwidth: float, latency: float, algorithms=("ring",)
) -> float:
    """Reduce-scatter then all-gather within a node, each by its fastest of ``algorithms``."""
    padded = parts * shard_bytes  # the reduce-scatter splits into equal shards
    scatter = min(reduce_scatter_time(parts, padded, bandwidth, latency, a) for a in algorithms)
    gather = min(allgather_time(parts, shard_bytes, bandwidth, latency, a) for a in algorithms)
    return scatter + gather


def _compression_time(method: Method, workload: Workload, cluster: Cluster) -> float:
    ct = method.compression_time
    compressed = workload
    if method.exchange == "two_level":  # each GPU compresses its shard only
        compressed = _shards(workload, cluster.gpus_per_node)
    if not callable(ct):
        if compressed is workload:
            return float(ct)
        return float(ct) * compressed.elements / workload.elements
    total = 0.0
    for n in compressed.buckets:
        v = float(ct(n))
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"compression_time({n}) = {v!r}: must be finite and >= 0")
        total += v
    return total


def _flat_ring_time(c: Cluster, nbytes: float) -> float:
    """One ring through every GPU: each step waits for its slowest hop."""
    if c.nodes == 1:
        bandwidth, latency = c.intra_bandwidth, c.intra_latency
    else:
        bandwidth = min(c.intra_bandwidth, 1.0 / c._inter_seconds_per_byte())
        latency = max(c.intra_latency, c.inter_latency)
    return allreduce_time(c.workers, nbytes, bandwidth, latency)


def _two_level_time(method: Method, c: Cluster, w: Workload) -> float:
    """Reduce-scatter within the node, sparse all-gather of the shards across, all-gather within."""
    i, j = c.gpus_per_node, c.nodes
    shard = _shards(w, i)
    intra = _local_phases_time(i, float(shard.nbytes), c.intra_bandwidth, c.intra_latency)
    # The node's i GPUs all-gather their shards' messages at once on its link.
    node_bundle = i * sparse_message_bytes(method, shard)
    inter_bw = 1.0 / c._inter_seconds_per_byte()
    return intra + allgather_time(j, node_bundle, inter_bw, c.inter_latency)


def _communication(method: Method, c: Cluster, w: Workload) -> float:
    i, j = c.gpus_per_node, c.nodes
    inter_bw = 1.0 / c._inter_seconds_per_byte()
    if not method.sparse:
        g = float(w.nbytes)
        if method.exchange == "flat_ring":
            return _flat_ring_time(c, g)
        intra = allreduce_time(i, g, c.intra_bandwidth, c.intra_latency)
        if method.exchange == "server":
            return intra + server_time(j, g, g, inter_bw, c.inter_latency)
        return intra + allreduce_time(j, g, inter_bw, c.inter_latency)
    if method.exchange == "two_level":
        return _two_level_time(method, c, w)
    m = sparse_message_bytes(method, w)
    if method.exchange == "allreduce":  # the paper's formula on the compressed size
        return allreduce_time(i, m, c.intra_bandwidth, c.intra_latency) + allreduce_time(
            j, m, inter_bw, c.inter_latency
        )
    intra = allgather_time(i, m, c.intra_bandwidth, c.intra_latency)
    if method.exchange == "server":  # node bundles pushed, dense mean pulled
        return intra + server_time(j, i * m, float(w.nbytes), inter_bw, c.inter_latency)
    return intra + allgather_time(j, i * m, inter_bw, c.inter_latency)


def _check_types(method, cluster, workload):
    for name, value, cls in (
        ("method", method, Method),
        ("cluster", cluster, Cluster),
        ("workload", workload, Workload),
    ):
        if not isinstance(value, cls):
            raise ValueError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")


def iteration_time(
    method: Method, cluster: Cluster, workload: Workload, *, overlap: bool = False
) -> IterationTime:
    """Predicted seconds of one iteration, by part.

    Args:
      method: what is trained and sent (:func:`dense_sgd`, :func:`ldte_bs`, ...).
      cluster: the machines and links.
      workload: batch time and gradient size.
      overlap: ``False`` (the paper's sum) or ``True``: communication fully
        hidden behind compute and compression (layer-wise overlap, §3.1),
        the ideal bound.

    Returns:
      :class:`IterationTime`. With one GPU in total nothing is communicated.

    Example:
      >>> c = Cluster(nodes=2, gpus_per_node=1, inter_bandwidth=1e9)
      >>> w = Workload(batch_time=0.1, gradient_elements=10**6)
      >>> t = iteration_time(dense_sgd(), c, w)  # 2 * 1/2 * 4 MB / 1 GB/s
      >>> t.communication, round(t.total, 9)
      (0.004, 0.104)
      >>> round(iteration_time(ldte_bs(1e-3, 0.001), c, w).communication * 1e6, 6)  # 6034 bytes
      6.034
    """
    _check_types(method, cluster, workload)
    overlap = V.check_bool("overlap", overlap)
    compute = workload.batch_time
    compression = _compression_time(method, workload, cluster) if method.sparse else 0.0
    comm = _communication(method, cluster, workload) if cluster.workers > 1 else 0.0
    total = max(compute + compression, comm) if overlap else compute + compression + comm
    return IterationTime(compute, compression, comm, total)


def throughput(
    method: Method, cluster: Cluster, workload: Workload, *, overlap: bool = False
) -> float:
    """Samples per second: ``i * j * batch_size / T_iter``.

    Example:
      >>> throughput(dense_sgd(), Cluster(), Workload(batch_time=0.5, gradient_elements=10,
      ...                                             batch_size=64))
      128.0
    """
    t = iteration_time(method, cluster, workload, overlap=overlap).total
    if t == 0:
        raise ValueError("iteration time is 0: give workload.batch_time > 0")
    return cluster.workers * workload.batch_size / t


def speedup(
    method: Method, cluster: Cluster, workload: Workload, *, overlap: bool = False
) -> float:
    """Throughput over dense SGD's on one GPU (``i j T_B / T_iter``; ideal: ``i j``).

    The paper's ``R_s`` is a speedup over conventional SGD; the ratio of two
    methods' speedups on one cluster does not depend on the baseline.

    Example:
      >>> c = Cluster(nodes=4, gpus_per_node=1, inter_bandwidth=1e9)
      >>> w = Workload(batch_time=0.1, gradient_elements=10**6)
      >>> round(speedup(dense_sgd(), c, w), 3)  # 4 * 0.1 / (0.1 + 2 * 3/4 * 4e-3)
      3.774
    """
    one = Cluster(
        nodes=1,
        gpus_per_node=1,
        intra_bandwidth=cluster.intra_bandwidth,
        inter_bandwidth=cluster.inter_bandwidth,
    )
    return throughput(method, cluster, workload, overlap=overlap) / throughput(
        dense_sgd(), one, workload
    )


# ---------------------------------------------------------------------------
# Per-bucket decision: does compression pay?
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExchangeDecision:
    """What :func:`compression_pays` chose for one bucket.

    Attributes:
      compress: whether a compressed exchange is predicted strictly faster.
      exchange: ``"dense"`` (ring all-reduce of the dense tensor, no
        compression), ``"sparse"`` (all-gather of the sparse messages) or
        ``"server"`` (sparse push, dense pull): the names of
        ``jaxcomp.comm.EXCHANGES`` plus the parameter server. With two
        levels, how the inter-node step moves each device's shard.
      dense_time: predicted seconds sending dense.
      compressed_time: predicted seconds of the best compressed exchange
        (compression included); ``inf`` when none was allowed.
      times: predicted seconds of every candidate, by exchange name
        (compute, compression and both levels included).
      intra_time: seconds of the dense reduce-scatter and all-gather within
        the node, part of every candidate's time (0 with one level).
      inter_times: seconds of each candidate's exchange among the
        ``n_devices`` peers (across nodes with two levels), without
        compression, compute or the intra-node part.

    Example:
      >>> d = compression_pays(10**6, 8, bandwidth=1e9, ratio=1e-3)
      >>> # dense: 2 * 7/8 * 4 MB / 1 GB/s; sparse: 7 * 1000 pairs * 8 B / 1 GB/s
      >>> d.compress, d.exchange, d.dense_time, d.compressed_time
      (True, 'sparse', 0.007, 5.6e-05)
      >>> d.intra_time, d.inter_times["sparse"]
      (0.0, 5.6e-05)
    """

    compress: bool
    exchange: str
    dense_time: float
    compressed_time: float
    times: Mapping[str, float]
    intra_time: float = 0.0
    inter_times: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.compress


def _check_local_level(local_devices, intra_bandwidth, intra_latency):
    """Validated ``(L, intra_bandwidth, intra_latency)`` of :func:`compression_pays`."""
    local = V.check_int("local_devices", local_devices, 1)
    if intra_bandwidth is None:
        if local > 1:
            raise ValueError(
                f"intra_bandwidth must be given (> 0) when local_devices > 1, got {local}"
            )
    else:
        intra_bandwidth = _positive("intra_bandwidth", intra_bandwidth)
    return local, intra_bandwidth, _nonneg("intra_latency", intra_latency)


def _check_exchanges(exchanges) -> tuple[str, ...]:
    if isinstance(exchanges, str) or not isinstance(exchanges, Sequence):
        raise ValueError(f"exchanges must be a sequence of {EXCHANGE_CHOICES}, got {exchanges!r}")
    exchanges = tuple(V.check_choice("exchanges", e, EXCHANGE_CHOICES) for e in exchanges)
    if "dense" not in exchanges:
        raise ValueError(f"exchanges must include 'dense', got {exchanges!r}")
    return exchanges


def _candidate_times(peers, local, dense_bytes, message, bandwidth, latency):
    """Seconds of each candidate across the ``peers``' link, carrying ``local`` devices' shards."""
    dense, bundle = local * dense_bytes, local * message  # the link is shared by the node
    return {
        "dense": min(allreduce_time(peers, dense, bandwidth, latency, a) for a in ALGORITHMS),
        "sparse": min(allgather_time(peers, bundle, bandwidth, latency, a) for a in ALGORITHMS),
        "server": server_time(peers, bundle, dense, bandwidth, latency),
    }


def compression_pays(
    size: int,
    n_devices: int,
    *,
    bandwidth: float,
    latency: float = 0.0,
    capacity: int | None = None,
    ratio: float | None = None,
    itemsize: int = 4,
    index_itemsize: int = _INDEX_ITEMSIZE,
    compression_time: float = 0.0,
    compute_time: float = 0.0,
    exchanges: Sequence[str] = EXCHANGE_CHOICES,
    overlap: bool = False,
    local_devices: int = 1,
    intra_bandwidth: float | None = None,
    intra_latency: float = 0.0,
) -> ExchangeDecision:
    """Whether compressing one gradient bucket beats sending it dense, and how.

    A cost model for one bucket of ``size`` elements on ``n_devices`` peers
    of one link (``bandwidth`` bytes/s, ``latency`` s per message), with the
    arguments of :func:`jaxcomp.comm.prefer_sparse` (``capacity``,
    ``size``, ``itemsize``, ``n_devices``, ``index_itemsize``) so that an
    exchange ``"auto"`` choice can call it at trace time with static Python
    numbers. Candidates (seconds, ``compute_time`` added to each):

    * ``"dense"``: all-reduce of ``size * itemsize`` bytes;
    * ``"sparse"``: ``compression_time`` + all-gather of ``capacity``
      (index, value) pairs (:func:`jaxcomp.comm.sparse_mean`);
    * ``"server"``: ``compression_time`` + parameter server, sparse push and
      dense pull (:func:`jaxcomp.comm.server_sparse_mean`).

    **Two levels** (``local_devices = L > 1``; ``axis_name=("node",
    "local")``): ``n_devices`` is then the number of nodes ``j`` and
    ``bandwidth``/``latency`` describe the inter-node link of a node, which
    its ``L`` devices share (as :class:`Cluster` models it). Every candidate
    first reduce-scatters the bucket within the node (``intra_bandwidth``,
    ``intra_latency``), leaving each device ``s = ceil(size / L)`` elements,
    and ends with their all-gather within the node: ``intra_time``, the same
    for every candidate. In between, the candidates above act on the
    shards, all ``L`` devices of a node at once: dense is an all-reduce of
    ``L * s * itemsize`` bytes on the node's link, sparse an all-gather of
    ``L`` messages of ``capacity`` pairs, where ``capacity`` (and
    ``compression_time``) are one device's for its shard. So the choice is
    per bucket whether to compress the inter-node step; the intra-node
    steps stay dense.

    Each collective takes the faster of the ring and the recursive
    halving/doubling algorithm (:data:`ALGORITHMS`): a tuned library picks
    the latter for small messages, where the ring's ``p - 1`` latencies
    would make compression look better than it is.
    With ``latency=0`` and ``compression_time=0`` the dense/sparse choice
    is :func:`jaxcomp.comm.prefer_sparse`'s byte comparison. Measured
    reality is harsher than byte counts: Agarwal et al., "On the Utility of
    Gradient Compression in Distributed Training Systems" (MLSys 2022),
    found compression beating well-tuned dense data parallelism (all-reduce
    overlapped with backward) in only 6 of more than 200 setups. Give
    measured ``compression_time`` and ``latency``, and prefer ``overlap=True``
    for the dense baseline when the framework overlaps it.

    Args:
      size: elements of the bucket (>= 1), before any reduce-scatter.
      n_devices: peers exchanging it (>= 1); with two levels, the nodes.
      bandwidth: bytes per second per link (> 0); with two levels, a
        node's inter-node link.
      latency: seconds per message (>= 0) on that link.
      capacity: (index, value) pairs in one device's message (for its shard
        with two levels, at most ``ceil(size / local_devices)``); or give
        ``ratio`` (``capacity = ceil(ratio * elements compressed)``). One of
        the two.
      ratio: compression ratio in (0, 1].
      itemsize: bytes per value.
      index_itemsize: bytes per index.
      compression_time: seconds to select/compress what one device
        compresses: the bucket, or with two levels its shard.
      compute_time: seconds of compute the exchange adds to (reported times
        only; with ``overlap`` the exchange hides behind it).
      exchanges: candidates to consider, a subset of :data:`EXCHANGE_CHOICES`
        (must include ``"dense"``).
      overlap: each candidate costs ``max(compute, exchange)`` instead of
        the sum (compression is never hidden).
      local_devices: devices per node ``L`` (>= 1); 1 (default): one level.
      intra_bandwidth: bytes per second between a node's devices (> 0);
        required when ``local_devices > 1``.
      intra_latency: seconds per message within a node (>= 0).

    Returns:
      :class:`ExchangeDecision` (truthy when compressing pays).

    Raises:
      ValueError: an argument out of range (named), neither or both of
        ``capacity`` and ``ratio``, an unknown exchange, or
        ``local_devices > 1`` without ``intra_bandwidth``.

    Example:
      >>> slow = compression_pays(2**22, 8, bandwidth=gbps(1), ratio=1e-3, compression_time=2e-3)
      >>> slow.compress, slow.exchange, round(slow.dense_time, 4), round(slow.compressed_time, 4)
      (True, 'sparse', 0.2349, 0.0039)
      >>> fast = compression_pays(2**22, 8, bandwidth=gbps(400), ratio=1e-3, compression_time=2e-3)
      >>> fast.compress, fast.exchange, round(fast.dense_time * 1e3, 3)
      (False, 'dense', 0.587)

      Two levels: 4 nodes of 8 devices, 1 GB/s between nodes, 100 GB/s
      within; 8M elements, so each device owns a 1M-element (4 MB) shard:

      >>> d = compression_pays(8 * 10**6, 4, bandwidth=1e9, ratio=1e-3,
      ...                      local_devices=8, intra_bandwidth=1e11)
      >>> round(d.intra_time, 9)  # 7/8 * 32 MB / 100 GB/s, then 7 * 4 MB / 100 GB/s
      0.00056
      >>> # dense: 2 * 3/4 * 8 * 4 MB / 1 GB/s; sparse: 3 * 8 * 1000 pairs * 8 B / 1 GB/s
      >>> round(d.inter_times["dense"], 9), round(d.inter_times["sparse"], 9)
      (0.048, 0.000192)
      >>> d.exchange, round(d.dense_time, 9), round(d.compressed_time, 9)
      ('sparse', 0.04856, 0.000752)
    """
    size = V.check_int("size", size, 1)
    n = V.check_int("n_devices", n_devices, 1)
    bandwidth = _positive("bandwidth", bandwidth)
    latency = _nonneg("latency", latency)
    local, intra_bandwidth, intra_latency = _check_local_level(
        local_devices, intra_bandwidth, intra_latency
    )
    shard = -(-size // local)  # elements each device compresses and exchanges across nodes
    if (capacity is None) == (ratio is None):
        raise ValueError("give exactly one of capacity and ratio")
    if capacity is None:
        capacity = target_count(V.check_ratio("ratio", ratio), shard)
    capacity = V.check_int("capacity", capacity, 1, shard)
    itemsize = V.check_int("itemsize", itemsize, 1)
    index_itemsize = V.check_int("index_itemsize", index_itemsize, 1)
    compression_time = _nonneg("compression_time", compression_time)
    compute_time = _nonneg("compute_time", compute_time)
    overlap = V.check_bool("overlap", overlap)
    exchanges = _check_exchanges(exchanges)

    shard_bytes = float(shard * itemsize)
    message = float(capacity * (index_itemsize + itemsize))
    inter = _candidate_times(n, local, shard_bytes, message, bandwidth, latency)
    intra = 0.0
    if local > 1:  # well-tuned collectives within the node too
        intra = _local_phases_time(local, shard_bytes, intra_bandwidth, intra_latency, ALGORITHMS)

    def total(name):
        extra = 0.0 if name == "dense" else compression_time
        comm = inter[name] + intra if local > 1 else inter[name]
        if overlap:
            return max(compute_time, comm) + extra
        return compute_time + extra + comm

    times = {name: total(name) for name in exchanges}
    best = min(exchanges, key=lambda e: (times[e], e != "dense"))  # ties: stay dense
    compressed = [times[e] for e in exchanges if e != "dense"]
    return ExchangeDecision(
        compress=best != "dense",
        exchange=best,
        dense_time=times["dense"],
        compressed_time=min(compressed) if compressed else math.inf,
        times=times,
        intra_time=intra,
        inter_times={name: inter[name] for name in exchanges},
    )
