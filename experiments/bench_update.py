"""The full update, as a training step runs it: the donated single-device ``tx.update``.

For each compressor (``ldte_bs``, ``ldte_bs`` with ``defer_residual=True``
(``ldte_bs_deferred``), ``top_k``, optionally ``gaussian_k`` and
``top_k_deferred``) at ``ratio = 1e-3`` and each size (default ``2^22`` and ``2^24`` float32
elements), it times exactly what a one-device training step pays for the
compressor::

    step = jax.jit(lambda g, s: tx.update(g, s), donate_argnums=1)
    u, s = step(g, s)  # the state threaded from call to call, as in a training loop

with ``g`` a fixed Laplacian gradient (``bench_selection.make_data``; with
``--data ties`` small integers, so that every step's selection passes far
more than the capacity and the capacity cut runs: the step's overflow
cost), after
``--warm_steps`` steps, as medians of ``--repeats`` rounds that interleave
every program of a size (one call each per round), so that the load of a
shared machine drifts over all of them alike. In the same rounds it times:

- ``floor``: one memory pass, ``jnp.sum(jnp.abs(x))``;
- ``contract``: the least a sparsifier can do under the optax contract on
  XLA:CPU, ``(where(|r + g| > t, r + g, 0), where(|r + g| > t, 0, r + g))``
  with ``r`` donated and ``t`` fixed (no selection): the dense update is an
  output, so with the gradient not donated one n-sized output buffer is
  fresh on every call;
- a breakdown by stage (each a separately compiled, donated program, so the
  differences are indicative): ``check`` (the non-finite check, one read of
  ``g``), ``accumulate`` (``r <- r + g``, in place), ``select``
  (accumulate, then the selector's threshold and count); ``send`` is
  ``update - select``: the mask, the overflow check, the dense update and
  residual outputs and any fresh buffers.

With ``--no_modes`` unset (the default) it also times, in the same rounds,
the two programs that a training step actually runs:

- ``gradient donated``: ``jax.jit(tx.update, donate_argnums=(0, 1))`` on a
  gradient buffer written before the clock starts. Inside a training step the
  gradient is a temporary of the step, so its buffer is free for the update:
  no n-sized output is fresh. With the gradient kept, one of the two n-sized
  outputs must be a fresh buffer on every call whatever the compressor does,
  and above glibc's largest mmap threshold (32 MiB, i.e. 2^23 float32) it is
  mapped and page-faulted anew each time (``contract`` measures that cost);
- ``gradient donated, timed alone``: the same program again after the
  rounds, ``--repeats`` consecutive calls of it alone, as a training loop
  calls its step. In the rounds, the programs that write fresh n-sized
  buffers (the kept-gradient updates, the train steps) change glibc's heap
  between calls, which costs the next program page faults; the floors of
  this mode are against the rounds' floor; the train steps below are timed
  alone the same way (``step_alone_*``);
- ``train step``: a whole jitted step with parameters and state donated,
  ``grad(0.5 |p - target|^2)``, ``optax.chain(tx, optax.sgd(0.1))`` and
  ``optax.apply_updates``, beside the same step with plain SGD
  (``dense_step``): what the user pays, compressor and all.

It also counts the memory passes of the compiled update from its HLO
(``hlo_passes``): every kernel that reads or writes an n-sized buffer, at
the top level (run on every call) or inside a conditional or loop body (run
only when taken), the input/output aliasing of the donated state and
``memory_analysis()`` (fresh temporaries; those of untaken branches are
allocated but never touched); and it times each of those kernels in the real
update from a ``jax.profiler`` trace (``profile_kernels``, ``kernels_ms``):
the per-pass breakdown of where the time goes.

Fresh n-sized buffers cost page faults on every call (glibc serves them
with ``mmap``): at ``2^24`` writing one costs about as much as all the
compressor's passes together. That is the process's allocator, not the
compiled program: ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35,
transparent huge pages for large blocks) set before Python starts cut the
first write of the fresh 64 MiB output from ~35 to ~9 ms here. The
environment's allocator settings are recorded in the JSON (``malloc_env``).

Ratios (``speedup_vs_top_k``, ``floors``) come from medians measured in the
same run. Writes ``<out>/bench_update.json`` and ``<out>/bench_update.png``
(``bench_update_ties.*`` with ``--data ties``).

Run: ``python -m experiments.bench_update [--sizes 22,24]
[--methods ldte_bs,ldte_bs_deferred,top_k] [--repeats 15] [--warm_steps 20] [--no_stages]
[--no_profile] [--no_modes] [--malloc default|hugetlb] [--data laplace|ties]
[--out results]``.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from absl import flags

from experiments import cli, jsonio
from experiments.bench_selection import make_data
from experiments.presets import build, spec
from experiments.timing import environment
from jaxcomp.selection import selectors

ETA = 1e-3
# name -> (preset of experiments.presets, built with ratio=ETA; the selector it runs).
METHODS = {
    "ldte_bs": (spec("ldte_bs"), selectors.ldte_bs),
    "top_k": (spec("top_k"), selectors.exact_top_k),
    "gaussian_k": (spec("gaussian_k"), selectors.gaussian_k),
    # defer_residual=True: the next step clears the message (jaxcomp.SparsifyState).
    "ldte_bs_deferred": (spec("ldte_bs", defer_residual=True), selectors.ldte_bs),
    "top_k_deferred": (spec("top_k", defer_residual=True), selectors.exact_top_k),
}
STAGES = ("check", "accumulate", "select")
STEP_LR = 0.1  # the SGD learning rate of the timed training steps
MALLOC_ENV = ("GLIBC_TUNABLES", "MALLOC_")
HUGETLB = "glibc.malloc.hugetlb=1"
TARGET_FLOORS = 8.0
TARGET_SPEEDUP = 4.0


def update_fn(tx):
    """The timed program: the whole ``tx.update`` with the state donated."""
    return jax.jit(lambda g, s: tx.update(g, s), donate_argnums=1)


def update_fn_grad_donated(tx):
    """The same update with the gradient donated too (its buffer may take the update).

    In a training step the gradient is a temporary of the compiled step, so XLA
    may reuse its buffer; this measures the update as it runs there: no fresh
    n-sized output (with the gradient kept, one output is necessarily fresh,
    and at 2^24 glibc maps and page-faults it on every call).
    """
    return jax.jit(lambda g, s: tx.update(g, s), donate_argnums=(0, 1))


def _quadratic_loss(params, target):
    return 0.5 * jnp.sum(jnp.square(params - target))


def train_step_fn(tx):
    """What the user pays: a whole jitted step, parameters and state donated.

    ``grad(0.5 |p - target|^2) = p - target`` (one elementwise pass, a
    temporary of the step), then ``tx.update`` and ``optax.apply_updates``.
    """

    def step(params, state, target):
        grads = jax.grad(_quadratic_loss)(params, target)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step, donate_argnums=(0, 1))


def _finite_grad(g):
    # What sparsify does first with nonfinite="skip" (the default): one full
    # reduction decides whether the step sends, then g is used as is or zeroed.
    finite = jnp.isfinite(jnp.sum(g - g))
    return jnp.where(finite, g, 0)


def stage_fns(select, k):
    """The breakdown programs, each ``(r, g) -> (..., r)`` with ``r`` donated (but ``check``)."""
    return {
        "check": (jax.jit(lambda g: jnp.isfinite(jnp.sum(g - g))), False),
        "accumulate": (jax.jit(lambda r, g: r + _finite_grad(g), donate_argnums=0), True),
        "select": (
            jax.jit(
                lambda r, g: (lambda acc: (*select(acc, k)[:2], acc))(r + _finite_grad(g)),
                donate_argnums=0,
            ),
            True,
        ),
    }


def contract_fn():
    """The optax contract's dense outputs from ``r + g`` and a fixed ``t``, ``r`` donated."""

    def f(r, g, t):
        # (update, residual) as tx.update returns them: output 0 reuses r's buffer.
        acc = r + g
        keep = jnp.abs(acc) > t
        return jnp.where(keep, acc, 0), jnp.where(keep, 0, acc)

    return jax.jit(f, donate_argnums=0)


# ---------------------------------------------------------------------------
# Memory passes from the compiled HLO.
# ---------------------------------------------------------------------------

_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "opt-barrier"}
_PARTIAL = {"slice", "dynamic-slice", "gather"}


def _computations(text):
    """``{name: (is_entry, [(name, type, opcode, rest), ...])}`` of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        head = re.match(r"^(ENTRY )?%(\S+) \(.*\) -> .* \{$", line)
        if head:
            cur = head.group(2)
            comps[cur] = (bool(head.group(1)), [])
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            m = re.match(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([\w-]+)\((.*)$", line)
            if m:
                comps[cur][1].append(m.groups())
    return comps


def _sizes(hlo_type):
    """Element counts of the arrays in an HLO type (a tuple type gives several)."""
    return [
        math.prod(int(d) for d in dims.split(",") if d)
        for dims in re.findall(r"\[([\d,]*)\]", hlo_type)
    ]


def _operands(rest):
    return re.findall(r"%([\w.\-]+)", rest.split("), ")[0])


def _full_reads(comps, instr, types, n):
    """n-sized operands an instruction reads in full (not just a slice or a gather)."""
    _, _, opcode, rest = instr
    big = [
        i
        for i, a in enumerate(_operands(rest))
        if any(s >= n // 2 for s in _sizes(types.get(a, "")))
    ]
    called = re.search(r"calls=%([\w.\-]+)", rest)
    if opcode != "fusion" or not called or called.group(1) not in comps:
        return len(big)
    body = comps[called.group(1)][1]
    params = {
        int(re.match(r"(\d+)", r).group(1)): name for name, _, op, r in body if op == "parameter"
    }

    def sliced_only(value, n_full):
        # True if every use of `value` inside the fusion ends in a slice or a
        # gather, possibly through elementwise ops and bitcasts of the same
        # size (XLA computes those only where the slice reads): the kernel
        # reads a few elements, not the buffer.
        users = [(nm, t, op) for nm, t, op, r in body if value in _operands(r)]
        return bool(users) and all(
            op in _PARTIAL or (_sizes(t) == [n_full] and sliced_only(nm, n_full))
            for nm, t, op in users
        )

    ops = _operands(rest)
    return sum(not sliced_only(params.get(i), max(_sizes(types[ops[i]]))) for i in big)


def _braced(text, key):
    """The text inside the balanced braces after ``key`` (empty if absent)."""
    start = text.find(key + "{")
    if start < 0:
        return ""
    depth, i0 = 0, start + len(key)
    for i in range(i0, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[i0 + 1 : i].strip()
    return ""


def hlo_passes(compiled, n):
    """The kernels of a compiled program that touch n-sized buffers, and a summary.

    Returns ``{"kernels": [...], "control": [...], "summary": {...}}``; each
    kernel has its ``name``, ``opcode``, ``reads`` and ``writes`` (n-sized
    operands read in full / n-sized outputs), ``where`` (``"every call"`` at
    the top level, else the conditional or loop it runs in), ``op`` (the JAX
    operation) and, if it computes one of the program's outputs, ``output``
    (its index in the flattened outputs); ``control`` lists the conditionals
    and loops.
    """
    text = compiled.as_text()
    comps = _computations(text)
    entry = next(name for name, (is_entry, _) in comps.items() if is_entry)
    kernels, control_ops = [], []

    def visit(comp, where, seen):
        instrs = comps[comp][1]
        types = {name: t for name, t, _, _ in instrs}
        for instr in instrs:
            name, t, opcode, rest = instr
            if opcode in _FREE:
                continue
            reads = _full_reads(comps, instr, types, n)
            control = opcode in ("while", "conditional")
            writes = 0 if control else sum(s >= n // 2 for s in _sizes(t))
            op = re.search(r'op_name="([^"]*)"', rest)
            if (reads or writes) and not control:
                kernels.append(
                    {
                        "name": name,
                        "opcode": opcode,
                        "reads": reads,
                        "writes": writes,
                        "where": where,
                        "op": op.group(1).split("/")[-1] if op else "",
                    }
                )
            if control:
                control_ops.append({"name": name, "opcode": opcode, "where": where})
                inner = re.findall(r"(?:condition|body|to_apply)=%([\w.\-]+)", rest)
                branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
                if branches:
                    inner += re.findall(r"%([\w.\-]+)", branches.group(1))
                label = (
                    f"{opcode} {name}" if where == "every call" else f"{where} > {opcode} {name}"
                )
                for c in inner:
                    if c in comps and c not in seen:
                        visit(c, label, seen | {c})

    visit(entry, "every call", {entry})
    # Which kernels write the program's outputs (flattened (updates, state):
    # output 0 is the update, output 2 the new residual).
    root = re.search(r"ROOT %\S+ = .*? tuple\((.*)\)", text[text.find("\nENTRY ") :])
    outputs = _operands(root.group(1) + "), ") if root else []
    for kk in kernels:
        if kk["where"] == "every call" and kk["name"] in outputs:
            kk["output"] = outputs.index(kk["name"])
    memory = compiled.memory_analysis()
    top = [kk for kk in kernels if kk["where"] == "every call"]
    alias = _braced(text, "input_output_alias=")
    nbytes = 4 * n
    summary = {
        "kernels_every_call": len(top),
        "reads_every_call": sum(kk["reads"] for kk in top),
        "writes_every_call": sum(kk["writes"] for kk in top),
        "kernels_conditional": len(kernels) - len(top),
        "copies_every_call": sum(kk["opcode"] == "copy" for kk in top),
        "temp_n": memory.temp_size_in_bytes / nbytes,
        "fresh_outputs_n": (memory.output_size_in_bytes - memory.alias_size_in_bytes) / nbytes,
        "aliased_n": memory.alias_size_in_bytes / nbytes,
        # e.g. "{0}: (2, {}, may-alias)": output 0 (the update) is written into the
        # buffer of parameter 2 (the donated residual).
        "input_output_alias": alias,
    }
    return {"kernels": kernels, "control": control_ops, "summary": summary}


def profile_kernels(fn, g, state, hlo, steps=5):
    """Mean ms per call of each kernel of ``hlo`` (and of each conditional/loop) in ``fn``.

    From a ``jax.profiler`` trace of ``steps`` calls (XLA:CPU names its events
    after the HLO instructions). A conditional's or loop's time includes the
    kernels run inside it. Returns ``(rows, state)``; ``rows`` is empty if the
    profiler is unavailable.
    """
    import collections
    import glob
    import gzip
    import tempfile

    per = collections.defaultdict(float)
    try:
        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d, create_perfetto_trace=True):
                for _ in range(steps):
                    u, state = jax.block_until_ready(fn(g, state))
                    del u
            (path,) = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
            with gzip.open(path) as f:
                events = json.load(f)["traceEvents"]
    except Exception as e:  # noqa: BLE001 - the timing is optional, the benchmark is not
        print(f"  (no kernel profile: {type(e).__name__}: {e})", flush=True)
        return [], state
    for e in events:
        if e.get("ph") == "X":
            per[e["name"]] += e["dur"] / 1e3 / steps
    rows = []
    for kk in [*hlo["kernels"], *hlo["control"]]:
        if kk["name"] in per:
            rows.append({**kk, "ms": per[kk["name"]]})
    return rows, state


# ---------------------------------------------------------------------------
# The benchmark.
# ---------------------------------------------------------------------------


_copy = jax.jit(lambda v: v * 1)


def _call(entry):
    """Runs one program once (threading its donated state); returns seconds."""
    fn, kind, args = entry["fn"], entry["kind"], entry["args"]
    t0 = time.perf_counter()
    if kind == "update":
        u, entry["state"] = jax.block_until_ready(fn(args[0], entry["state"]))
        del u
    elif kind == "update_grad_donated":
        # A fresh gradient buffer for every call, written before the clock
        # starts (as a step's backward pass would have written it).
        g = jax.block_until_ready(_copy(args[0]))
        t0 = time.perf_counter()
        u, entry["state"] = jax.block_until_ready(fn(g, entry["state"]))
        del u
    elif kind == "step":
        entry["params"], entry["state"] = jax.block_until_ready(
            fn(entry["params"], entry["state"], *args)
        )
    elif kind == "donated":
        out = jax.block_until_ready(fn(entry["state"], *args))
        # The program's new donated state comes last (`select`: acc;
        # `contract`: the residual).
        entry["state"] = out[-1] if isinstance(out, tuple) else out
        del out
    else:
        jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _step_entry(tx, g):
    """A :func:`train_step_fn` program: parameters 0, target ``g`` (the first gradient is -g)."""
    params = jnp.zeros_like(g)
    return {
        "fn": train_step_fn(tx),
        "kind": "step",
        "args": (g,),
        "params": params,
        "state": tx.init(params),
    }


def run(
    sizes_log2,
    methods,
    repeats,
    out_dir,
    warm_steps=20,
    stages=True,
    profile=True,
    modes=True,
    data="laplace",
):
    """Times every method's donated update at every size; returns the result rows.

    ``stages``: also time the breakdown programs; ``profile``: also time each
    kernel of the update from a profiler trace (``profile_kernels``);
    ``modes``: also time the update with the gradient donated
    (:func:`update_fn_grad_donated`) and the whole training step
    (:func:`train_step_fn`, beside the dense SGD step).
    """
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods must be among {sorted(METHODS)}, got unknown {unknown}")
    methods = list(dict.fromkeys(["top_k", *methods]))  # top_k is the baseline, always run
    results = []
    for lg in sizes_log2:
        n = 2**lg
        k = selectors.target_count(ETA, n)
        g = jnp.asarray(make_data(data, n))
        progs, hlo, kernel_ms = _size_programs(
            g, k, methods, warm_steps, stages=stages, profile=profile, modes=modes
        )
        med = _time_programs(progs, methods, repeats, modes)
        row = _size_row(lg, k, progs, med, hlo, kernel_ms, methods, stages=stages, modes=modes)
        results.append(row)
        _print_row(row)
    _write_results(results, data, repeats, warm_steps, out_dir)
    return results


def _size_programs(g, k, methods, warm_steps, *, stages, profile, modes):
    """``(programs to time, HLO passes, profiled kernels)`` of every method at one size.

    Each method's update is warmed up for ``warm_steps`` (its state then the
    steady one), with the breakdown stages, gradient-donated update and train
    step when asked, beside the one-pass floor and the fixed-threshold contract.
    """
    n = g.size
    progs = {"floor": {"fn": jax.jit(lambda v: jnp.sum(jnp.abs(v))), "kind": "plain"}}
    progs["floor"]["args"] = (g,)
    hlo, sel_out, kernel_ms = {}, {}, {}
    for m in methods:
        preset, select = METHODS[m]
        tx = build(preset, ratio=ETA)
        fn = update_fn(tx)
        state = tx.init(g)
        hlo[m] = hlo_passes(fn.lower(g, state).compile(), n)
        for _ in range(warm_steps):
            _, state = fn(g, state)
        state = jax.block_until_ready(state)  # no queued steps in what follows
        if profile:
            kernel_ms[m], state = profile_kernels(fn, g, state, hlo[m])
        progs[m] = {"fn": fn, "kind": "update", "args": (g,), "state": state}
        if stages:
            for stage, (sfn, donated) in stage_fns(select, k).items():
                entry = {"fn": sfn, "kind": "donated" if donated else "plain"}
                entry["args"] = (g,)
                if donated:
                    entry["state"] = jnp.zeros_like(g)
                progs[f"{m}/{stage}"] = entry
        sel_out[m] = state
        if modes:
            gfn = update_fn_grad_donated(tx)
            gstate = tx.init(g)
            for _ in range(warm_steps):
                _, gstate = gfn(_copy(g), gstate)
            progs[f"{m}/grad_donated"] = {
                "fn": gfn,
                "kind": "update_grad_donated",
                "args": (g,),
                "state": jax.block_until_ready(gstate),
            }
            progs[f"{m}/step"] = _step_entry(optax.chain(tx, optax.sgd(STEP_LR)), g)
    if modes:
        progs["dense_step"] = _step_entry(optax.sgd(STEP_LR), g)
    t_fixed = jnp.float32(sel_out["top_k"].threshold)
    progs["contract"] = {
        "fn": contract_fn(),
        "kind": "donated",
        "args": (g, t_fixed),
        "state": jnp.zeros_like(g),
    }
    return progs, hlo, kernel_ms


def _time_programs(progs, methods, repeats, modes):
    """Median milliseconds of every program (interleaved rounds; alone for the modes)."""
    times = {name: [] for name in progs}
    for rnd in range(repeats + 2):  # two warm-up rounds (compilation, first touch)
        for name, entry in progs.items():
            dt = _call(entry)
            if rnd >= 2:
                times[name].append(dt)
    med = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    if modes:
        # The gradient-donated updates again, each timed alone: consecutive
        # calls of one program, as a training loop makes them. In the rounds
        # above the programs with fresh n-sized buffers (the kept-gradient
        # updates, the train steps) change the allocator's state between
        # calls.
        # The train steps too: what a training loop pays per step.
        alone = [f"{m}/{mode}" for m in methods for mode in ("grad_donated", "step")]
        for name in [*alone, "dense_step"]:
            ts = [_call(progs[name]) for _ in range(repeats + 2)][2:]
            med[f"{name}_alone"] = 1e3 * statistics.median(ts)
    return med


def _size_row(lg, k, progs, med, hlo, kernel_ms, methods, *, stages, modes):
    """The result row of one size: each method's times, ratios, counts and kernels."""
    n = 2**lg
    floor = med["floor"]
    row = {
        "log2_n": lg,
        "n": n,
        "k": k,
        "floor_ms": floor,
        "contract_ms": med["contract"],
        "contract_floors": med["contract"] / floor,
        "methods": {},
    }
    for m in methods:
        state = progs[m]["state"]
        entry = {
            "update_ms": med[m],
            "floors": med[m] / floor,
            "over_contract": med[m] / med["contract"],
            # The one leaf's entries of the per-leaf arrays.
            "search_iterations": int(jnp.sum(state.search_iterations)),
            "sent_count": int(jnp.sum(state.sent_count)),
            "sent_over_k": int(jnp.sum(state.sent_count)) / k,
            "hlo": hlo[m],
        }
        if m in kernel_ms:
            # Per-kernel means of a profiled run (slower than the timed
            # calls, and the machine drifts): shares, not exact times.
            entry["kernels_ms"] = kernel_ms[m]
            top = [kk for kk in kernel_ms[m] if kk["where"] == "every call"]
            entry["profiled_ms"] = sum(kk["ms"] for kk in top)
        if modes:
            entry["grad_donated_ms"] = med[f"{m}/grad_donated"]
            entry["grad_donated_floors"] = med[f"{m}/grad_donated"] / floor
            entry["grad_donated_alone_ms"] = med[f"{m}/grad_donated_alone"]
            entry["grad_donated_alone_floors"] = med[f"{m}/grad_donated_alone"] / floor
            entry["step_ms"] = med[f"{m}/step"]
            entry["step_floors"] = med[f"{m}/step"] / floor
            entry["step_over_dense"] = med[f"{m}/step"] / med["dense_step"]
            entry["step_alone_ms"] = med[f"{m}/step_alone"]
            entry["step_alone_floors"] = med[f"{m}/step_alone"] / floor
            entry["step_alone_over_dense"] = med[f"{m}/step_alone"] / med["dense_step_alone"]
        if stages:
            st = {s: med[f"{m}/{s}"] for s in STAGES}
            st["send"] = med[m] - st["select"]
            entry["stages_ms"] = st
            entry["stages_floors"] = {s: v / floor for s, v in st.items()}
        row["methods"][m] = entry
    if modes:
        row["dense_step_ms"] = med["dense_step"]
        row["dense_step_floors"] = med["dense_step"] / floor
        row["dense_step_alone_ms"] = med["dense_step_alone"]
        row["dense_step_alone_floors"] = med["dense_step_alone"] / floor
    base = row["methods"]["top_k"]
    for entry in row["methods"].values():
        entry["speedup_vs_top_k"] = base["update_ms"] / entry["update_ms"]
        if modes:
            entry["grad_donated_speedup_vs_top_k"] = (
                base["grad_donated_ms"] / entry["grad_donated_ms"]
            )
            entry["grad_donated_alone_speedup_vs_top_k"] = (
                base["grad_donated_alone_ms"] / entry["grad_donated_alone_ms"]
            )
            entry["step_speedup_vs_top_k"] = base["step_ms"] / entry["step_ms"]
            entry["step_alone_speedup_vs_top_k"] = base["step_alone_ms"] / entry["step_alone_ms"]
    return row


def _write_results(results, data, repeats, warm_steps, out_dir):
    """Writes ``bench_update[_<data>].json`` (rows and the run's metadata) and its plot."""
    meta = {
        "data": data,
        "eta": ETA,
        "repeats": repeats,
        "warm_steps": warm_steps,
        "targets": {"max_floors": TARGET_FLOORS, "min_speedup_vs_top_k": TARGET_SPEEDUP},
        **environment(),
        # Allocator settings change the cost of fresh buffers (see the module
        # docstring): recorded so that runs with and without them are told apart.
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith(MALLOC_ENV)},
    }
    os.makedirs(out_dir, exist_ok=True)
    name = "bench_update" if data == "laplace" else f"bench_update_{data}"
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        jsonio.dump({"meta": meta, "results": results}, f, indent=1)
    png = plot(results, os.path.join(out_dir, f"{name}.png"))
    print(f"wrote {path} and {png}")


def _kernel_label(kk):
    rw = f"R{kk['reads']}W{kk['writes']}" if "reads" in kk else kk["opcode"]
    out = f" -> output {kk['output']}" if "output" in kk else ""
    return f"{kk['name']} ({kk.get('op') or kk['opcode']}, {rw}{out})"


def _print_row(row):
    print(
        f"2^{row['log2_n']}: floor {row['floor_ms']:.3f} ms, contract {row['contract_ms']:.2f} ms"
        f" ({row['contract_floors']:.1f} floors)",
        flush=True,
    )
    if "dense_step_ms" in row:
        print(
            f"  dense SGD step {row['dense_step_ms']:.2f} ms"
            f" ({row['dense_step_floors']:.1f} floors);"
            f" timed alone {row['dense_step_alone_ms']:.2f} ms",
            flush=True,
        )
    for m, e in row["methods"].items():
        s = e["hlo"]["summary"]
        print(
            f"  {m:10s} {e['update_ms']:8.2f} ms {e['floors']:5.1f} floors"
            f" {e['speedup_vs_top_k']:5.2f}x top_k | {e['search_iterations']} it,"
            f" sent {e['sent_over_k']:.2f}k | HLO every call: {s['kernels_every_call']} n-sized"
            f" kernels, {s['reads_every_call']} reads, {s['writes_every_call']} writes,"
            f" {s['copies_every_call']} copies; temp {s['temp_n']:.2f} n,"
            f" fresh outputs {s['fresh_outputs_n']:.2f} n",
            flush=True,
        )
        if "step_ms" in e:
            print(
                f"    gradient donated {e['grad_donated_ms']:.2f} ms"
                f" {e['grad_donated_floors']:.1f} floors"
                f" {e['grad_donated_speedup_vs_top_k']:.2f}x top_k | train step"
                f" {e['step_ms']:.2f} ms {e['step_floors']:.1f} floors"
                f" {e['step_speedup_vs_top_k']:.2f}x top_k,"
                f" {e['step_over_dense']:.2f}x the dense step",
                flush=True,
            )
            print(
                f"    gradient donated, timed alone {e['grad_donated_alone_ms']:.2f} ms"
                f" {e['grad_donated_alone_floors']:.1f} floors"
                f" {e['grad_donated_alone_speedup_vs_top_k']:.2f}x top_k | train step"
                f" {e['step_alone_ms']:.2f} ms {e['step_alone_floors']:.1f} floors"
                f" {e['step_alone_speedup_vs_top_k']:.2f}x top_k,"
                f" {e['step_alone_over_dense']:.2f}x the dense step",
                flush=True,
            )
        if "stages_floors" in e:
            print(
                "    stage programs (floors): "
                + ", ".join(f"{k} {v:.1f}" for k, v in e["stages_floors"].items()),
                flush=True,
            )
        for kk in e.get("kernels_ms", []):
            if kk["where"] == "every call" and kk["ms"] >= 0.02 * e["update_ms"]:
                print(f"    {kk['ms']:8.2f} ms  {_kernel_label(kk)}", flush=True)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["methods"])
    ncol = 1 + len(names)
    # The bar chart gets a column per two methods (five bars each).
    wide = max(1.0, len(names) / 2)
    fig, axes = plt.subplots(
        len(results),
        ncol,
        figsize=(5.2 * (ncol - 1 + wide), 4.4 * len(results)),
        squeeze=False,
        gridspec_kw={"width_ratios": [wide] + [1] * (ncol - 1)},
    )
    for axrow, row in zip(axes, results, strict=True):
        ax = axrow[0]
        # One bar per method and mode: (label, floors key, speedup key).
        modes = [("update", "floors", "speedup_vs_top_k")]
        if "step_floors" in row["methods"][names[0]]:
            modes += [
                ("gradient donated", "grad_donated_floors", "grad_donated_speedup_vs_top_k"),
                (
                    "gradient donated, alone",
                    "grad_donated_alone_floors",
                    "grad_donated_alone_speedup_vs_top_k",
                ),
                ("train step", "step_floors", "step_speedup_vs_top_k"),
                ("train step, alone", "step_alone_floors", "step_alone_speedup_vs_top_k"),
            ]
        width = 0.8 / len(modes)
        floors = []
        for j, (label, fkey, skey) in enumerate(modes):
            xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(names))]
            vals = [row["methods"][m][fkey] for m in names]
            floors += vals
            ax.bar(xs, vals, width, color=f"C{j}", label=label)
            for x, m, v in zip(xs, names, vals, strict=True):
                ax.annotate(
                    f"{v:.1f}\n{row['methods'][m][skey]:.1f}x",
                    (x, v),
                    textcoords="offset points",
                    xytext=(0, 2),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.axhline(
            TARGET_FLOORS, color="r", ls="--", lw=1, label=f"target {TARGET_FLOORS:g} floors"
        )
        ax.axhline(
            row["contract_floors"], color="k", ls=":", lw=1.5, label="contract (no selection)"
        )
        ax.set_ylim(0, 1.3 * max(floors + [TARGET_FLOORS, row["contract_floors"]]))
        ax.set_xticks(range(len(names)), names, rotation=15)
        ax.set_ylabel("one-pass floors (sum |x|)")
        ax.set_title(
            f"n = 2^{row['log2_n']}: floors and speedup vs top_k (floor {row['floor_ms']:.2f} ms)",
            fontsize=9,
        )
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
        for ax, m in zip(axrow[1:], names, strict=True):
            e = row["methods"][m]
            ks = [
                kk
                for kk in e.get("kernels_ms", [])
                if kk["where"] == "every call" and kk["ms"] >= 0.005 * e["update_ms"]
            ]
            ks = sorted(ks, key=lambda kk: kk["ms"])[-12:]
            ax.barh(range(len(ks)), [kk["ms"] for kk in ks], color="C7")
            ax.set_yticks(range(len(ks)), [_kernel_label(kk) for kk in ks], fontsize=7)
            ax.set_xlabel("ms per call (profiled)")
            ax.set_title(f"{m}, 2^{row['log2_n']}: top-level kernels", fontsize=9)
            ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle(
        f"top-{ETA:g} update on {jax.default_backend()} ({jax.__version__}); R/W = n-sized"
        " buffers read/written; a cond/while includes its kernels"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("sizes", "22,24", "log2 sizes", **fv)
    flags.DEFINE_string(
        "methods", "ldte_bs,ldte_bs_deferred,top_k", f"among {sorted(METHODS)}", **fv
    )
    flags.DEFINE_integer("repeats", 15, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_integer("warm_steps", 20, "Steps before the timing.", **fv)
    flags.DEFINE_bool("no_stages", False, "skip the stage breakdown", **fv)
    flags.DEFINE_bool("no_profile", False, "skip the kernel profile", **fv)
    flags.DEFINE_bool(
        "no_modes",
        False,
        "skip the gradient-donated update and the whole training step",
        **fv,
    )
    flags.DEFINE_string("out", "results", "Output directory.", **fv)
    flags.DEFINE_enum(
        "data",
        "laplace",
        ["laplace", "ties"],
        "ties: small-integer gradients, every step over the capacity (its cut's cost)",
        **fv,
    )
    flags.DEFINE_enum(
        "malloc",
        "default",
        ["default", "hugetlb"],
        "hugetlb: rerun this program with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 "
        "(transparent huge pages for large blocks; see the module docstring)",
        **fv,
    )


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    if args.malloc == "hugetlb" and HUGETLB not in os.environ.get("GLIBC_TUNABLES", ""):
        # glibc reads its tunables once, at process start: start again with them.
        tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), HUGETLB) if t)
        env = {**os.environ, "GLIBC_TUNABLES": tunables}
        rest = cli.command(argv)[1:]
        os.execve(sys.executable, [sys.executable, "-m", "experiments.bench_update", *rest], env)
    cli.check_repeats(args.repeats)
    run(
        [int(s) for s in args.sizes.split(",")],
        [m for m in args.methods.split(",") if m],
        args.repeats,
        args.out,
        warm_steps=args.warm_steps,
        stages=not args.no_stages,
        profile=not args.no_profile,
        modes=not args.no_modes,
        data=args.data,
    )


if __name__ == "__main__":
    cli.run(main, define_flags)
