"""The exchanges of quantized messages: all-gather, compressed all-reduce, server, gossip, vote.

Every quantizing compressor (:func:`jaxcomp.quantize`) runs one of
:data:`QUANTIZER_EXCHANGES` (or, for sign codecs, :data:`VOTE_EXCHANGES`)
over its leaves' messages inside ``shard_map``. The exchange is per step, not
per leaf: the messages of all leaves travel in one buffer per dtype, and one
collective per buffer, so the collectives of a step do not grow with the
number of leaves:

- ``"allgather"``: the packed codes and the scales are all-gathered; every
  device decodes all ``N`` messages and averages them in device order (a
  ``lax.scan`` adding one device's decoded messages per step in the
  accumulation dtype, :func:`_mean_of_messages`), so all devices get
  bit-identical updates.
- ``"server"``: a parameter server (device 0) receives every message,
  decodes and averages them in device order and sends the dense mean back
  (:func:`jaxcomp.comm.server_mean`'s pattern; bytes per worker link: its
  message plus the dense pull; ``N - 1`` ppermutes per buffer each way,
  whatever the group's size). A group of ``servers = M`` servers
  (:func:`jaxcomp.comm.server_devices`) shards the coded leaves by leaf
  (:func:`jaxcomp.comm.assign_to_servers`: a leaf's codes and bucket
  scales decode only together, so a key range cannot cut them): server
  ``j`` receives, decodes and averages the messages of its leaves and sends
  their dense means back; leaves sent dense are sharded by key range
  (:func:`jaxcomp.comm.server_mean`). Each leaf's mean is the one server's,
  bit for bit.
- ``"gossip"``: decentralized, not an average: each device sends its message
  to its two ring neighbours and its update is the mix (1/3 each) of its own
  and their decoded messages (:func:`jaxcomp.comm.gossip_mean`'s ring),
  different per device; two messages on the wire, one ppermute per buffer
  and direction.
- ``"allreduce"``: a compressed all-reduce whose bytes scale like a ring
  all-reduce's: the leaf is cut into ``N`` chunks, each encoded as its own
  message; an all-to-all gives device ``j`` chunk ``j`` of every device
  (row ``j`` of the buffers holds chunk ``j`` of every leaf), which it
  decodes, averages (in the accumulation dtype) and encodes again; an
  all-gather of the ``N`` re-encoded mean chunks gives every device the
  update. ``2 (N - 1)`` chunk messages per device, about ``2 (N-1)/N``
  messages against the all-gather's ``N - 1``. The last chunk is zero-padded
  to the common length and its codec sees the zeros (a sign codec's last
  bucket counts them in ``||x||_1 / d``; elementwise codecs, casts and
  natural compression, are unaffected). The mean is quantized a second
  time: a cast rounds the float32 mean to 16 bits once more (as the DDP
  hooks' result is 16-bit), a randomized codec draws again (still unbiased).
- ``"majority"`` (sign codecs only; signSGD with majority vote, Bernstein et
  al. 2018): the messages are all-gathered as for ``"allgather"`` (same
  bytes) but aggregated by vote: per coordinate ``sign(sum_d sign(S_d))``, a
  tie giving 0, times the mean ``|S_d|`` over the devices that voted (a
  device that sends nothing abstains). For unit signs (Signum) that is
  exactly ``+-1`` or 0; for scaled signs, the majority sign at the devices'
  mean scale. Leaves sent dense are all-gathered and voted on the same way,
  with their full-precision values.

The leaves are decoded from their slices of the buffers (those of one size
together, by one vmapped decoder) and averaged (or voted on) in one loop over
the devices; the results are those of exchanging each leaf on its own, bit
for bit (compiled as the tests compile; at XLA:CPU's default backend
optimisation, which contracts ``a * b + c`` into FMAs kernel by kernel, a
gossip mix can round a few ulp apart: seen for a dense scalar leaf and for
the cast codec). With ``include=`` (backup workers) the included-device
count (a float32) is all-reduced once per buffer, not once per leaf.

:func:`exchange_leaves` is the entry point: it takes each leaf's
:class:`Encoded` (this device's half of the step) and returns the updates,
the bytes on the wire and, per leaf, what float16 saturation cut off the
update (which error feedback keeps in the residual).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm import collectives
from jaxcomp.comm.collectives import array_nbytes
from jaxcomp.quantization.codecs import Quantizer

# Public to the package (jaxcomp.quantize runs them), not part of the API:
# Encoded, exchange_leaves, to_dtype.
__all__ = [
    "QUANTIZER_EXCHANGES",
    "VOTE_EXCHANGES",
    "QuantizedExchange",
]


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedExchange:
    """The static options of one quantized exchange.

    Attributes:
      quantizer: the codec of the messages.
      axis_name: the mesh axis (or axes) to exchange over; ``None``: one
        device (the local decoded update).
      exchange: one of :data:`QUANTIZER_EXCHANGES` or :data:`VOTE_EXCHANGES`.
      acc_dtype: the float dtype the decoded messages are summed in.
      error_feedback: whether the caller keeps a residual (then what float16
        saturation cuts off an update is returned, to be kept in it).
      servers: ``"server"``: the parameter servers of the group (1: one).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.comm.quantized import QuantizedExchange
      >>> from jaxcomp.quantization import sign_quantizer
      >>> ex = QuantizedExchange(sign_quantizer(), None, "allgather", jnp.float32, True)
      >>> ex.exchange
      'allgather'
    """

    quantizer: Quantizer
    axis_name: Any
    exchange: str
    acc_dtype: Any
    error_feedback: bool
    servers: int = 1


def to_dtype(x: jax.Array, dtype) -> jax.Array:
    """Casts to ``dtype``, saturating at its largest finite value (float16).

    A bucket's scale can exceed float16's range although every element fits
    (QSGD's L2 norm of a large leaf); saturating keeps the update finite and,
    with error feedback, the excess in the residual.
    """
    dtype = jnp.dtype(dtype)
    big = float(jnp.finfo(dtype).max)
    if big < float(jnp.finfo(x.dtype).max):
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


class Encoded(NamedTuple):
    """One leaf after its local, per-device half of a step (before the exchange).

    ``sent`` is what this device contributes, flat in the gradient dtype (its
    decoded message, or the dense values); ``message`` the ``(codes, scales)``
    that travel, None for a leaf sent dense (``exchange="allreduce"``: the
    ``N`` chunk messages, stacked).
    """

    shape: tuple
    out_dtype: Any
    acc: jax.Array  # the flat accumulator R, in the residual dtype
    sent: jax.Array
    message: Any
    decoded: Any  # float32 decoded message (the gossip mix's own part)
    key: Any  # this leaf's PRNG key (the all-reduce encodes its mean with it)
    nbytes: jax.Array
    velocity: Any


class _Packing:
    """Where each of a list of arrays sits in one flat buffer per dtype.

    :meth:`pack` concatenates the arrays, flattened after their first
    ``lead`` axes (shared by all), into one buffer per dtype, so that one
    collective moves all of them; :meth:`unpack` cuts any array that carries
    those buffers in its last axis (gathered: ``[N, total]``; one device's
    row: ``[total]``) back into the arrays, with its other leading axes kept.
    Buffers are a dict keyed by dtype name (a pytree ``lax.scan`` can slice).
    """

    def __init__(self, arrays, lead: int = 0):
        self.lead = lead
        self.slots = []  # per array: (dtype name, start, size, trailing shape)
        self.sizes = {}  # per dtype name: the buffer's length
        for a in arrays:
            dt, shape = jnp.dtype(a.dtype).name, tuple(a.shape[lead:])
            start = self.sizes.get(dt, 0)
            self.slots.append((dt, start, math.prod(shape), shape))
            self.sizes[dt] = start + math.prod(shape)

    def pack(self, arrays) -> dict:
        parts = {dt: [] for dt in self.sizes}
        for a, (dt, _, size, _) in zip(arrays, self.slots, strict=True):
            parts[dt].append(a.reshape(a.shape[: self.lead] + (size,)))
        return {dt: p[0] if len(p) == 1 else jnp.concatenate(p, axis=-1) for dt, p in parts.items()}

    def unpack(self, buffers) -> list:
        out = []
        for dt, start, size, shape in self.slots:
            b = buffers[dt]
            part = b if size == b.shape[-1] else b[..., start : start + size]
            out.append(part.reshape(b.shape[:-1] + shape))
        return out


def _same_size(leaves) -> list:
    """``[(n, [i, ...]), ...]``: the indices of the leaves of each size ``n``, first seen first."""
    groups = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(leaf.sent.size, []).append(i)
    return list(groups.items())


def _over_leaves(fn, k: int):
    """``fn`` mapped over ``k`` stacked leaves (a leading axis): vmapped, or one leaf alone.

    Alone, a leaf gets the kernels of a per-leaf exchange: XLA:CPU at its
    default optimisation compiled a vmap over one row to kernels that rounded
    differently (FMAs contracted elsewhere) in the gossip mix and the cast.
    """
    if k > 1:
        return jax.vmap(fn)
    return lambda *args: jax.tree.map(lambda y: y[None], fn(*(x[0] for x in args)))


def _ungroup(groups, stacked) -> list:
    """Per leaf, its row of its size's stacked array (the inverse of :func:`_same_size`)."""
    out = [None] * sum(len(idx) for _, idx in groups)
    for (_, idx), rows in zip(groups, stacked, strict=True):
        for k, i in enumerate(idx):
            out[i] = rows[k]
    return out


# Values of the quantizers' ``exchange`` argument, for every codec.
QUANTIZER_EXCHANGES = ("allgather", "allreduce", "server", "gossip")
# Exchanges that aggregate by vote, for sign codecs only (``Quantizer.signs``).
VOTE_EXCHANGES = ("majority",)


def _first_and_rest(messages):
    return jax.tree.map(lambda m: m[0], messages), jax.tree.map(lambda m: m[1:], messages)


def _saturate(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``x`` (float32) in ``dtype`` saturated at its largest finite value, and what that cut off.

    The cut (float32, 0 where ``x`` fits) is what a float16 sum past 65504
    could not hold: the caller keeps it in the residual rather than losing it.
    """
    big = float(jnp.finfo(dtype).max)
    held = jnp.clip(x, -big, big)
    return held.astype(dtype), x - held


def _mean_of_messages(decode, messages, denom, acc_dtype, split=None, cut=False) -> list:
    """Means of ``decode(messages[d])`` over the leading (device) axis, in device order.

    ``messages`` is a pytree of arrays with a leading device axis, ``decode``
    maps one device's slice of it to a list of decoded arrays (one per leaf,
    or per stack of leaves: every leaf of a step is averaged in the same
    loop), and the result is the list of their means, the sums first mapped
    by ``split`` (stacks to leaves: each leaf divided on its own, as in a
    per-leaf exchange, where XLA fuses the division into the leaf's next
    operations and may rewrite it there, e.g. ``(t / N) / s`` as ``t * (1 /
    (N s))``). A ``lax.scan`` that decodes one device's messages per
    step into running sums in ``acc_dtype``: XLA:CPU reduces a stacked
    ``[N, n]`` array over its leading axis ~50x slower than it adds rows, and
    this never materializes it. At least float32: sum, then divide by
    ``denom``. Narrower (bfloat16, float16): each message divided by
    ``denom`` first, as PyTorch DDP's fp16 hook divides before its all-reduce
    (no overflow; exact for a power-of-two ``denom``, bar underflow), and
    every partial sum rounded to ``acc_dtype``, as an all-reduce in that
    dtype rounds, and saturated at its largest finite value (float16: 65504)
    where it would overflow to inf.

    With ``cut=True`` the result is ``(means, cuts)``: per mean, what
    saturation cut off it (float32; the mean of the decoded messages is
    ``mean + cut`` up to the partial sums' rounding); ``cuts`` is None at
    least float32.
    """
    narrow = jnp.finfo(acc_dtype).bits < 32
    denom = jnp.asarray(denom, jnp.float32)

    def term(message):
        if not narrow:
            return [x.astype(acc_dtype) for x in decode(message)], None
        pairs = [_saturate(x / denom, acc_dtype) for x in decode(message)]
        return [t for t, _ in pairs], [c for _, c in pairs]

    def body(carry, message):
        totals, cuts = carry
        terms, term_cuts = term(message)
        if not narrow:
            return ([t + x for t, x in zip(totals, terms, strict=True)], None), None
        # Added in float32 and rounded once: float16's own sum, bar its overflow.
        sums = [
            _saturate(t.astype(jnp.float32) + x.astype(jnp.float32), acc_dtype)
            for t, x in zip(totals, terms, strict=True)
        ]
        totals = [t for t, _ in sums]
        cuts = [c + tc + sc for c, tc, (_, sc) in zip(cuts, term_cuts, sums, strict=True)]
        return (totals, cuts), None

    # The first message starts the sum (it carries the messages' device-varying type).
    first, rest = _first_and_rest(messages)
    (totals, cuts), _ = lax.scan(body, term(first), rest)
    totals = totals if split is None else split(totals)
    means = totals if narrow else [t / denom.astype(acc_dtype) for t in totals]
    if not cut:
        return means
    if not narrow:  # nothing saturates: no cuts
        return means, None
    return means, cuts if split is None else split(cuts)


def _majority_of_messages(decode, messages, acc_dtype) -> list:
    """Majority votes over the leading (device) axis of decoded sign messages.

    Each device votes ``sign(S_d)`` per coordinate (0: abstains, e.g. a device
    that sent nothing); the result is ``sign(sum_d sign(S_d))`` (a tie is 0)
    times the mean ``|S_d|`` of the devices that voted: exactly ``+-1`` or 0
    for unit signs (Signum), the devices' mean scale for scaled signs, and a
    single device's own ``S``. ``messages``, ``decode`` (a list of leaves) and
    the loop as in :func:`_mean_of_messages`.
    """

    def term(message):
        def one(x):
            vote = jnp.sign(x)  # integers: the tally is exact in float32 up to 2^24 devices
            return vote, (vote != 0).astype(jnp.int32), to_dtype(jnp.abs(x), acc_dtype)

        return [one(x) for x in decode(message)]

    def body(carry, message):
        def add(c, t):
            (tally, voters, size), (vote, voted, mag) = c, t
            # Added in float32: a float16 sum past 65504 saturates, not inf.
            size = _saturate(size.astype(jnp.float32) + mag.astype(jnp.float32), acc_dtype)[0]
            return tally + vote, voters + voted, size

        return [add(c, t) for c, t in zip(carry, term(message), strict=True)], None

    def result(tally, voters, size):
        mean_size = size / jnp.maximum(voters, 1).astype(acc_dtype)
        return jnp.sign(tally).astype(acc_dtype) * mean_size

    first, rest = _first_and_rest(messages)
    carry, _ = lax.scan(body, term(first), rest)
    return [result(*c) for c in carry]


def exchange_leaves(ex: QuantizedExchange, leaves, include):
    """The exchanged updates (flat, gradient dtype) of ``leaves``, the bytes sent, the excess.

    All leaves sent dense travel in one buffer per dtype, all messages in
    one buffer per dtype of their codes and scales: the collectives of a
    step do not grow with the number of leaves. The excess, per leaf, is
    what saturation cut off this device's share of the update (float32,
    flat; None where nothing can be cut): see :func:`_kept_excess`.
    """
    if ex.axis_name is None:
        return [leaf.sent for leaf in leaves], jnp.float32(0), [None] * len(leaves)
    dense = [j for j, leaf in enumerate(leaves) if leaf.message is None]
    coded = [j for j, leaf in enumerate(leaves) if leaf.message is not None]
    out, wire, excess = [None] * len(leaves), jnp.float32(0), [None] * len(leaves)
    for idx, run in ((dense, _exchange_dense), (coded, _exchange_messages)):
        if idx:
            updates, w, *cut = run(ex, [leaves[j] for j in idx], include)
            for k, (j, u) in enumerate(zip(idx, updates, strict=True)):
                out[j] = u
                excess[j] = cut[0][k] if cut else None
            wire = wire + w
    return out, wire, excess


def _kept_excess(
    ex: QuantizedExchange, means, leaves, include, cuts=None, owner_cuts=None, count=None
):
    """Per leaf, the excess this device keeps in its residual (float32, flat), or None.

    A float16 mean saturates at 65504 where the devices' messages add up
    to more: in the accumulation (``accumulation_dtype=float16``,
    ``cuts``) and in the cast to a float16 gradient dtype. Every device
    that counted in the mean keeps what was cut, so that the residuals
    together keep ``count`` times what the update could not hold
    (``sum_d residual_d + count * update == sum_d (old residual_d +
    grad_d)``, up to the partial sums' rounding), as
    :func:`jaxcomp.sparsify` keeps a float16 leaf's share. With
    ``owner_cuts`` (``"allreduce"``, ``"server"``: only the device that
    averaged knows its mean's cut) that device keeps ``count`` times it.
    None where nothing can be cut (float32 sums and gradients): the
    residual is then computed as before, bit for bit.
    """
    kept = []
    for i, (mean, leaf) in enumerate(zip(means, leaves, strict=True)):
        cut = None if cuts is None else cuts[i]
        big = float(jnp.finfo(leaf.out_dtype).max)
        if big < float(jnp.finfo(jnp.float32).max):  # the cast to the gradient dtype
            wide = mean.astype(jnp.float32)
            over = jnp.isfinite(wide) & (jnp.abs(wide) > big)
            cast_cut = jnp.where(over, wide - jnp.clip(wide, -big, big), 0)
            cut = cast_cut if cut is None else cut + cast_cut
        if cut is not None and include is not None:
            cut = jnp.where(include, cut, 0)
        if owner_cuts is not None:
            owned = count * owner_cuts[i]
            cut = owned if cut is None else cut + owned
        kept.append(cut if ex.error_feedback else None)
    return kept


def _exchange_dense(ex: QuantizedExchange, leaves, include):
    values = [leaf.sent for leaf in leaves]
    if ex.exchange == "gossip":
        return _gossip_dense(ex, values)
    packing = _Packing(values)
    means, wire = {}, jnp.float32(0)
    for dt, b in packing.pack(values).items():
        if ex.exchange == "server":
            means[dt], w = collectives.server_mean(b, ex.axis_name, servers=ex.servers)
        elif ex.exchange == "majority":
            means[dt], w = _gather_vote_dense(ex, b)
        else:
            means[dt], w = collectives.dense_mean(b, ex.axis_name, include=include)
        wire = wire + w
    return packing.unpack(means), wire


def _gossip_dense(ex: QuantizedExchange, values):
    # collectives.gossip_mean's ring, one ppermute per buffer and direction,
    # and its mix leaf by leaf, as each leaf's own gossip_mean mixed: XLA:CPU
    # contracts w x + w' y into an FMA or not depending on the kernel, and a
    # mix over the whole buffer rounded a leaf 1 ulp away. (At XLA's default
    # backend optimisation a scalar's mix, fused differently, can still be.)
    packing = _Packing(values)
    from_left, from_right = collectives.ring_neighbours(packing.pack(values), ex.axis_name)
    if collectives.axis_size(ex.axis_name) == 1:
        return values, jnp.float32(0)
    weights = collectives.check_gossip_weights(collectives.GOSSIP_WEIGHTS)
    parts = zip(values, packing.unpack(from_left), packing.unpack(from_right), strict=True)
    mixed = [collectives.ring_mix(x, left, right, weights) for x, left, right in parts]
    return mixed, jnp.float32(2 * sum(array_nbytes(x) for x in values))


def _exchange_messages(ex: QuantizedExchange, leaves, include):
    # Leaves of one size are stacked and decoded by one vmapped decoder:
    # a leaf's own decoder would read its own slice of the buffers, one
    # kernel per leaf, where XLA compiles one per shape for the per-leaf
    # ex.exchange (it deduplicates identical kernels): ResNet-20's 65 leaves
    # have 13 sizes. Decoders are elementwise: the same bits either way.
    groups = _same_size(leaves)
    if ex.exchange == "allreduce":
        return _allreduce(ex, leaves, groups, include)
    if ex.exchange == "server":
        return _server_exchange(ex, leaves, include)
    buffers, decode, push, split = _stacked_messages(ex, leaves, groups)
    excess = [None] * len(leaves)
    if ex.exchange == "gossip":
        means, wire = _gossip_mix(ex, buffers, decode, split, leaves, push)
    elif ex.exchange == "majority":
        means, wire = _gather_mean(ex, buffers, decode, split, include, push)
    else:
        means, wire, cuts = _gather_mean(ex, buffers, decode, split, include, push)
        excess = _kept_excess(ex, means, leaves, include, cuts=cuts)
    updates = [to_dtype(m, leaf.out_dtype) for m, leaf in zip(means, leaves, strict=True)]
    return updates, wire, excess


def _stacked_messages(ex: QuantizedExchange, leaves, groups):
    """``leaves``' messages stacked by size and packed in one buffer per dtype.

    Returns ``(buffers, decode, push, split)``: the buffers, the decoder of
    one device's row of them, the bytes of one device's messages and the map
    from per-size stacks back to leaves.
    """
    messages = [jnp.stack([leaves[j].message[p] for j in idx]) for p in (0, 1) for _, idx in groups]
    packing = _Packing(messages)
    decode = _stacked_decoder(ex, packing, [n for n, _ in groups])
    push = sum(array_nbytes(m) for m in messages)
    return packing.pack(messages), decode, push, functools.partial(_ungroup, groups)


def _stacked_decoder(ex: QuantizedExchange, packing, sizes):
    """One device's row of the buffers -> per size, its leaves' decoded messages ``[k, n]``."""

    def decode(row):
        parts = packing.unpack(row)
        codes, scales = parts[: len(sizes)], parts[len(sizes) :]
        return [
            _over_leaves(functools.partial(ex.quantizer.decode, n=n), c.shape[0])(c, s)
            for n, c, s in zip(sizes, codes, scales, strict=True)
        ]

    return decode


def _include_count(ex: QuantizedExchange, include):
    """(The mean's denominator, bytes of the included-device count): one psum per call."""
    n_dev = collectives.axis_size(ex.axis_name)
    if include is None or ex.exchange == "majority":  # a vote needs no count
        return jnp.float32(n_dev), 0.0
    count = lax.psum(jnp.asarray(include, jnp.float32), ex.axis_name)
    return jnp.maximum(count, 1.0), collectives.allreduce_bytes(4, n_dev)


def _gather_mean(ex: QuantizedExchange, buffers, decode, split, include, push):
    n_dev = collectives.axis_size(ex.axis_name)
    denom, extra = _include_count(ex, include)
    gathered = {dt: collectives.all_gather_invariant(b, ex.axis_name) for dt, b in buffers.items()}
    wire = jnp.float32(collectives.allgather_bytes(push, n_dev) + extra)
    if ex.exchange == "majority":
        return split(_majority_of_messages(decode, gathered, ex.acc_dtype)), wire
    means, cuts = _mean_of_messages(decode, gathered, denom, ex.acc_dtype, split, cut=True)
    return means, wire, cuts


def _allreduce(ex: QuantizedExchange, leaves, groups, include):
    """A compressed all-reduce: reduce-scatter by all-to-all, then all-gather.

    Each leaf was cut into ``N`` chunks, each encoded as its own message
    (:func:`encode_leaf`); device ``j`` receives chunk ``j`` of every
    device (``all_to_all``), decodes and averages them in the accumulation
    dtype, encodes that mean chunk again and all-gathers it. Every leaf's
    chunks travel together: row ``j`` of the packed buffers holds chunk
    ``j`` of all leaves (stacked by size, as in :func:`_exchange_messages`).
    """
    n_dev = collectives.axis_size(ex.axis_name)
    chunks = [-(-n // n_dev) for n, _ in groups]
    messages = [
        jnp.stack([leaves[j].message[p] for j in idx], axis=1) for p in (0, 1) for _, idx in groups
    ]  # [N, k, ...]
    packing = _Packing(messages, lead=1)
    denom, extra = _include_count(ex, include)
    # Row d of the result: device d's messages for this device's chunks.
    got = {dt: lax.all_to_all(b, ex.axis_name, 0, 0) for dt, b in packing.pack(messages).items()}
    decode = _stacked_decoder(ex, packing, chunks)
    means, cuts = _mean_of_messages(
        decode, got, denom, ex.acc_dtype, functools.partial(_ungroup, groups), cut=True
    )
    # Each mean chunk encoded again on its own, as in a per-leaf ex.exchange: a
    # codec's divisions and reductions batched over leaves compile to other
    # HLO (XLA rewrote cast's (t / count) / scale into t * (1 / (count *
    # scale)) for one leaf only), and the all-reduce's result must not change.
    mean_messages = [
        ex.quantizer.encode(mean.astype(jnp.float32), jax.random.fold_in(leaf.key, n_dev))
        for mean, leaf in zip(means, leaves, strict=True)
    ]
    mean_codes, mean_scales = (
        [jnp.stack([mean_messages[j][p] for j in idx]) for _, idx in groups] for p in (0, 1)
    )
    m_messages = mean_codes + mean_scales
    m_packing = _Packing(m_messages)
    gathered = m_packing.unpack(
        {
            dt: collectives.all_gather_invariant(b, ex.axis_name)
            for dt, b in m_packing.pack(m_messages).items()
        }
    )  # [N, k, ...]
    updates = []
    parts = zip(chunks, gathered[: len(groups)], gathered[len(groups) :], strict=True)
    for c, codes, scales in parts:
        decode = jax.vmap(functools.partial(ex.quantizer.decode, n=c))  # over the N chunks
        decoded = _over_leaves(decode, codes.shape[1])(
            *(jnp.swapaxes(x, 0, 1) for x in (codes, scales))
        )
        updates.append(decoded)  # [k, N, c]: per leaf, its chunks in order
    means = [
        u.reshape(-1)[: leaf.sent.size]
        for u, leaf in zip(_ungroup(groups, updates), leaves, strict=True)
    ]
    owner_cuts = None
    if cuts is not None:
        # This device owns chunk j of every leaf: its cut sits at chunk j.
        j = lax.axis_index(ex.axis_name)
        owner_cuts = [
            lax.dynamic_update_slice(
                jnp.zeros(n_dev * cut.size, jnp.float32), cut, (j * cut.size,)
            )[: leaf.sent.size]
            for cut, leaf in zip(cuts, leaves, strict=True)
        ]
    excess = _kept_excess(ex, means, leaves, include, owner_cuts=owner_cuts, count=denom)
    updates = [to_dtype(m, leaf.out_dtype) for m, leaf in zip(means, leaves, strict=True)]
    wire = 2 * collectives.allgather_bytes(sum(array_nbytes(m) for m in m_messages), n_dev) + extra
    return updates, jnp.float32(wire), excess


def _gather_vote_dense(ex: QuantizedExchange, values):
    # Small leaves' full-precision values, all-gathered and voted on.
    n_dev = collectives.axis_size(ex.axis_name)
    gathered = collectives.all_gather_invariant(values, ex.axis_name)
    as_f32 = lambda v: [v.astype(jnp.float32)]  # noqa: E731
    (vote,) = _majority_of_messages(as_f32, gathered, ex.acc_dtype)
    wire = collectives.allgather_bytes(array_nbytes(values), n_dev)
    return to_dtype(vote, values.dtype), jnp.float32(wire)


def _gossip_mix(ex: QuantizedExchange, buffers, decode, split, leaves, push):
    # This device's ring mix of its own and its two neighbours' decoded
    # messages (in the accumulation dtype, then cast once): decentralized,
    # differs per device. Mixed leaf by leaf, as the means are divided.
    from_left, from_right = collectives.ring_neighbours(buffers, ex.axis_name)
    if collectives.axis_size(ex.axis_name) == 1:
        return [leaf.decoded for leaf in leaves], jnp.float32(0)
    w_self, w_left, w_right = (jnp.asarray(w, ex.acc_dtype) for w in collectives.GOSSIP_WEIGHTS)
    mixed = []
    lefts, rights = split(decode(from_left)), split(decode(from_right))
    for leaf, left, right in zip(leaves, lefts, rights, strict=True):
        mine, left, right = (to_dtype(p, ex.acc_dtype) for p in (leaf.decoded, left, right))
        mixed.append(w_self * mine + w_left * left + w_right * right)
    return mixed, jnp.float32(2 * push)


def _server_exchange(ex: QuantizedExchange, leaves, include):
    """The parameter servers' exchange of coded leaves: each server its share of the leaves.

    Server ``j`` (device ``server_devices(N, M)[j]``) receives the messages
    of the leaves :func:`jaxcomp.comm.assign_to_servers` gives it, decodes
    and averages them in device order and sends the dense means back; one
    server (``M = 1``) takes every leaf. The shares differ in size: each
    dtype's buffer is padded to the largest share's, so that round ``r`` of
    the push and of the pull is one ``ppermute`` per dtype whatever ``M``
    (:func:`jaxcomp.comm.collectives.push_to_servers`). Returns the updates,
    the bytes on a worker's link (:func:`jaxcomp.comm.server_link_bytes`
    over the servers, padding not counted) and what saturation cut off each
    mean (kept by its server).
    """
    n_dev = collectives.axis_size(ex.axis_name)
    devices = collectives.server_devices(n_dev, ex.servers)
    nbytes = [sum(array_nbytes(m) for m in leaf.message) for leaf in leaves]
    shares = collectives.assign_to_servers(nbytes, ex.servers)
    # The servers with leaves to serve (a server without any is left out).
    served = [(d, share) for d, share in zip(devices, shares, strict=True) if share]
    group = tuple(d for d, _ in served)
    stacked = []
    for _, share in served:
        part = [leaves[j] for j in share]
        stacked.append(_stacked_messages(ex, part, _same_size(part)))
    pushed = _to_servers(ex, [buffers for buffers, *_ in stacked], group)
    updates, excess, served_means = [None] * len(leaves), [None] * len(leaves), []
    for (device, share), (buffers, decode, _, split) in zip(served, stacked, strict=True):
        mine = {dt: pushed[dt][:, : b.shape[-1]] for dt, b in buffers.items()}
        means, cuts = _mean_of_messages(decode, mine, n_dev, ex.acc_dtype, split, cut=True)
        if cuts is not None:  # only the server's means (and their cut) are the server's
            on_server = lax.axis_index(ex.axis_name) == device
            cuts = [jnp.where(on_server, c, 0) for c in cuts]
        part = [leaves[j] for j in share]
        kept = _kept_excess(ex, means, part, include, owner_cuts=cuts, count=jnp.float32(n_dev))
        for j, cut in zip(share, kept, strict=True):
            excess[j] = cut
        served_means.append(means)
    packings = [_Packing(means) for means in served_means]
    packed = [p.pack(m) for p, m in zip(packings, served_means, strict=True)]
    for (_, share), packing, buffers in zip(
        served, packings, _from_servers(ex, packed, group), strict=True
    ):
        for j, mean in zip(share, packing.unpack(buffers), strict=True):
            updates[j] = to_dtype(mean, leaves[j].out_dtype)
    idle = [0] * (len(devices) - len(served))
    pushes = [push for _, _, push, _ in stacked] + idle
    pulls = [
        sum(leaves[j].sent.size * jnp.dtype(leaves[j].out_dtype).itemsize for j in share)
        for _, share in served
    ] + idle
    link = collectives.server_link_bytes(pushes, pulls, n_dev)
    return updates, jnp.float32(link["worker"]), excess


def _padded_rows(per_server: list) -> dict:
    """Per dtype, the servers' flat buffers padded to the longest: ``(M, L)``."""
    dtypes = {dt: b.dtype for buffers in per_server for dt, b in buffers.items()}
    rows = {}
    for dt, dtype in dtypes.items():
        length = max(buffers[dt].shape[-1] if dt in buffers else 0 for buffers in per_server)
        rows[dt] = jnp.stack([
            jnp.pad(buffers[dt], (0, length - buffers[dt].shape[-1]))
            if dt in buffers else jnp.zeros((length,), dtype)
            for buffers in per_server
        ])  # fmt: skip
    return rows


def _to_servers(ex: QuantizedExchange, per_server: list, group) -> dict:
    """Each server's buffers from every worker, ``(N, L)`` per dtype (padded)."""
    return {
        dt: collectives.push_to_servers(rows, ex.axis_name, group, per_server=True)
        for dt, rows in _padded_rows(per_server).items()
    }


def _from_servers(ex: QuantizedExchange, per_server: list, group) -> list:
    """Each server's packed means on every device, cut back to their lengths."""
    pulled = {
        dt: collectives.pull_from_servers(rows, ex.axis_name, group)
        for dt, rows in _padded_rows(per_server).items()
    }
    return [
        {dt: pulled[dt][j, : b.shape[-1]] for dt, b in buffers.items()}
        for j, buffers in enumerate(per_server)
    ]
