"""What each op of an emulated step asks of the hardware, by window of the step
(docs/design.md#the-time-model).

``StepWork`` is a dispatch mode that runs beside the ``MemoryTracker`` in the fake-tensor step
and sorts every op into *work*: FLOPs of matmuls and of attention kernels, bytes of memory-bound
kernels, kernel launches, bytes of collectives and of host<->device copies. Work, not time:
FLOPs, bytes and counts are polynomials in the sequence length on the fit's lattice (quadratic
at most), so the fit (``fit``) predicts them at paper scale exactly, and ``time_model`` prices
them with a hardware profile at the target's own shapes.

Work is kept per *window*: ``(stage, block)``, the step's stage (forward, backward, optimizer;
the tracker's outermost phase) and the transformer block the op ran in (the innermost
``layers.i`` phase label; None outside the blocks: embedding, loss, optimizer). Keys of a
window's ``Counter``:

    ("matmul", dtype, (m, n, k))                  FLOPs of (m x k) @ (k x n) products
    ("attention", kernel, dtype, pass, d, (s_k, heads, group))
                                                  FLOPs as ``profile.attention_flops`` counts
                                                  (heads: batch x query heads of a call;
                                                  group: query heads per K/V head in it)
    ("memory",)                                   bytes read + written by memory-bound kernels,
                                                  and C read by accumulating matmuls
                                                  (``addmm_``: C = C + A @ B; one stage's dx
                                                  update at U = 1 is bound by it; the product's
                                                  own bytes are its roofline's, ``time_model``)
    ("kernels",)                                  kernel launches
    ("comm", mechanism, op, scope)                bytes this rank sends (bus bytes); scope
                                                  intra (a group inside the node) or inter
                                                  (across nodes; an all-to-all's bytes for
                                                  other nodes only)
    ("comm", mechanism, "all_to_all", "node")     an all-to-all across nodes: its bytes for
                                                  peers on this rank's node
    ("comm_calls", mechanism, op, scope)          calls
    ("comm" | "comm_calls", "async", op, scope, n) the same, of torch's ring's n-th collective
    ("cover", n, *key)                            the work (a key above, kernels only) run on
                                                  the compute stream while that collective
                                                  was in flight
    ("copy", mechanism, direction[, flag])        host<->device bytes (direction h2d / d2h);
                                                  "pinned": a buffer pinned whatever the
                                                  cell's length (DeepSpeed FPDT's), else the
                                                  harness's rule (``pin_host_memory``);
                                                  "warm": d2h into host pages written
                                                  before (``_was_written``)

The mechanism says how the code runs it, which decides its overlap (``time_model``):

- collectives: ``fsdp`` (FSDP2's all-gathers and reduce-scatters), ``p2p`` (send / recv: the
  ring's K/V rotation, ``upipe/ring.py``; its backward's dK/dV exchange is ``blocking``, as it
  is waited for before the next step's kernel), ``async`` (torch's CP ring,
  ``baselines/torch_cp.py``: functional collectives waited for a step or more later, each with
  the kernels it runs beside, its ``cover``), ``overlap`` (all-to-alls issued with
  ``async_op=True`` by
  ``upipe.comm._all_to_all_async``: UPipe's overlapped stages, waited on after the next
  stage's attention kernel), ``blocking`` (everything else: the Ulysses all-to-alls and UPipe's
  without overlap, ``upipe/comm.py``, issued and waited on the compute stream);
- copies: ``side`` (``upipe.host.HostStore.write`` / ``prefetch``, on its side stream; DeepSpeed
  FPDT's, issued on its own side streams: ``baselines.ds_fpdt_portable.on_side_stream``), ``sync``
  (the ALST stack's offloaded checkpoints, ``upipe/stack/offload.py``, and
  ``HostStore.get`` without prefetch: on the compute stream).

Ops that launch no kernel are skipped: views, allocations (``empty``), metadata queries. Ops on
host tensors only (zeroing a host accumulator) run on the CPU beside the GPU and are not priced.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter, defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from baselines.ds_fpdt_portable import on_side_stream
from experiments.instruments.collectives import COLLECTIVE_NAMESPACES, describe_collective
from experiments.instruments.memory import HOST, MemoryTracker, plain_tensors, tensor_leaves
from experiments.instruments.op_flops import flop_formula
from experiments.timing.profile import attention_flops

Window = tuple[str, int | None]

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # bytes per element of each name

# c10d op -> the profile's collective op
COLLECTIVE_OPS = {
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_": "all_gather", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "send": "p2p", "recv_": "p2p",
    "recv_any_source_": "p2p",
    # a broadcast relays the tensor along a ring or tree, as an all-gather moves its pieces
    "broadcast_": "all_gather",
    # functional collectives (torch's CP ring, torch.distributed._functional_collectives)
    "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
}
# torch's CP ring (``_templated_ring_attention`` and its backward): its K/V (and, in backward,
# dK/dV) exchanges are functional collectives, each waited for where the rotater's
# ``next_buffer`` is next called: a K/V exchange at the start of the next step (the all-gather
# rotation's one gather thus runs beside the first step's attention only), a dK/dV exchange
# after the next step's attention kernel. Each gets its own key and its cover (``_settle``).
_TORCH_RING_FILE = "tensor/experimental/_context_parallel/_attention.py"

_aten = torch.ops.aten
_MATMUL = {_aten.mm.default: (0, 1), _aten.addmm.default: (1, 2), _aten.bmm.default: (0, 1),
           _aten.baddbmm.default: (1, 2), _aten.addmm_.default: (1, 2),
           _aten.baddbmm_.default: (1, 2)}  # op -> positions of its two factors
# Allocation-only ops: the caching allocator hands out memory, no kernel runs. And
# ``_unsafe_view``: a view whose schema does not say so (``func.is_view`` is False), which matmul
# and reshape return over a tensor they made (ATen's ``_unsafe_view`` is ``view`` without the
# alias annotation: no copy, no kernel; a copy, where one is needed, is a ``clone`` before it).
_NO_KERNEL = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
              _aten.new_empty.default, _aten.new_empty_strided.default,
              _aten._local_scalar_dense.default, _aten.lift_fresh.default,
              _aten.record_stream.default, _aten._unsafe_view.default}


def launches_kernel(func) -> bool:
    """Whether an aten op may launch a kernel: not a collective, a view, an allocation or a
    primitive (``StepWork`` counts it when it touches a device tensor)."""
    return (func.namespace not in COLLECTIVE_NAMESPACES and not func.is_view
            and func not in _NO_KERNEL and func.namespace != "prim")


def _attention_op(func) -> tuple[str, str, bool] | None:
    """(kernel name, pass, layout "bhsd" | "bshd") of an attention kernel op, else None."""
    name = f"{func.namespace}::{func._opname}"
    return _ATTENTION_OPS.get(name)


_ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("sdpa", "fwd", "bhsd"),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ("sdpa", "bwd", "bhsd"),
    "aten::_scaled_dot_product_flash_attention": ("sdpa", "fwd", "bhsd"),
    "aten::_scaled_dot_product_flash_attention_backward": ("sdpa", "bwd", "bhsd"),
    "aten::_scaled_dot_product_efficient_attention": ("sdpa", "fwd", "bhsd"),
    "aten::_scaled_dot_product_efficient_attention_backward": ("sdpa", "bwd", "bhsd"),
    "aten::_scaled_dot_product_cudnn_attention": ("cudnn", "fwd", "bhsd"),
    "aten::_scaled_dot_product_cudnn_attention_backward": ("cudnn", "bwd", "bhsd"),
    "upipe_emul::flash_fwd": ("flash-attn", "fwd", "bshd"),
    "upipe_emul::flash_bwd": ("flash-attn", "bwd", "bshd"),
    "upipe_emul::fa3_fwd": ("fa3", "fwd", "bshd"),
    "upipe_emul::fa3_bwd": ("fa3", "bwd", "bshd"),
}


def _bound(func, args, kwargs) -> dict:
    schema = func._schema.arguments
    return {a.name: v for a, v in zip(schema, args, strict=False)} | kwargs


def _called_from(path_part: str, functions: tuple[str, ...] = ()) -> bool:
    """Whether a frame on the Python stack is in a file whose path contains ``path_part`` (and,
    if given, in one of ``functions``). Asked only for collectives and host copies: a few per
    block, not per op."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if path_part in code.co_filename.replace("\\", "/") and (
                not functions or code.co_name in functions):
            return True
        frame = frame.f_back
    return False


def _fsdp_unit() -> tuple[bool, int | None]:
    """(whether FSDP2 issued the current collective, the block index of its unit: None for the
    root). FSDP2 issues a unit's all-gather from ``FSDPParamGroup.unshard`` (possibly while
    another block runs: prefetch) and its reduce-scatter from ``post_backward``; the unit is the
    param group's ``_module_fqn`` (``layers.3``; ``""`` for the root). Private API, present from
    torch 2.5 to 2.13."""
    frame = sys._getframe(2)
    while frame is not None:
        if "fsdp/_fully_shard/_fsdp_param_group" in frame.f_code.co_filename.replace("\\", "/"):
            fqn = getattr(frame.f_locals.get("self"), "_module_fqn", None)
            if fqn is not None:
                head, _, rest = fqn.partition(".")
                return True, int(rest.partition(".")[0]) if head == "layers" and rest else None
        frame = frame.f_back
    return False, None


def _nbytes(tensors) -> int:
    return sum(p.numel() * p.element_size() for t in tensors for p in plain_tensors(t))


class StepWork(TorchDispatchMode):
    """Sorts the ops run while active into work per window (see the module).

    Args:
        tracker: the step's ``MemoryTracker`` (its phase labels give the window, its storage
            kinds tell host from device tensors).
        gpus_per_node: ranks per node, to tell a group inside a node from one across nodes.

    Attributes:
        windows: {window: Counter(work key -> FLOPs, bytes or count)}.
        order: windows in the order they first ran.
    """

    def __init__(self, tracker: MemoryTracker, gpus_per_node: int):
        super().__init__()
        self.tracker, self.gpus_per_node = tracker, gpus_per_node
        self.windows: dict[Window, Counter] = defaultdict(Counter)
        self.order: list[Window] = []
        # torch's ring's collectives not yet waited for: [number, window, attention kernels
        # run since], and the number the next one gets (``_settle``)
        self._in_flight: list[list] = []
        self._issued = 0
        # host storages whose pages have been written (``_was_written``); weak: the tracker
        # sees a storage freed when its last reference goes
        self._written: weakref.WeakSet = weakref.WeakSet()

    # -- where an op runs ----------------------------------------------------------------------

    def _window_key(self, block: int | None | bool = False) -> Window:
        """The current window (``block``: that block's window in the current stage instead of
        the one the labels say)."""
        key = self.tracker.phase_key
        stage = key[0] if key else "setup"
        if block is False:
            block = next((int(n[len("layers."):].partition(":")[0]) for n in key
                          if n.startswith("layers.")), None)
        return stage, block

    def _window(self, block: int | None | bool = False) -> Counter:
        """The current window's work (``block`` as in ``_window_key``)."""
        window = self._window_key(block)
        if window not in self.windows:
            self.order.append(window)
        return self.windows[window]

    def _scope(self, group, peer: int | None) -> str:
        """"intra" if the ranks this rank talks to share its node, else "inter"."""
        ranks = dist.get_process_group_ranks(group)
        me = ranks[group.rank()]
        peers = ranks if peer is None else [ranks[peer]]
        node = me // self.gpus_per_node
        return "intra" if all(r // self.gpus_per_node == node for r in peers) else "inter"

    def _across_and_within(self, call) -> tuple[int, int]:
        """(bytes for other nodes, bytes for this node's peers) of an even all-to-all across
        nodes, on its slowest rank: the one with the fewest of the group on its node sends the
        most through its NIC. That of a rank with the most of the group on its node is taken
        for NVLink's share; both are this rank's on a group spread evenly over its nodes."""
        ranks = dist.get_process_group_ranks(call.group)
        on_node = Counter(r // self.gpus_per_node for r in ranks).values()
        chunk = call.payload // len(ranks)
        return chunk * (len(ranks) - min(on_node)), chunk * (max(on_node) - 1)

    # -- a replayed call's share (``replay``): the work it added to the current window ---------

    def mark(self) -> tuple[list[Window], dict[Window, Counter]]:
        return list(self.order), {w: Counter(c) for w, c in self.windows.items()}

    def since(self, mark) -> Counter | None:
        """The work added since ``mark`` to the current window; None if any other window
        changed (a call whose work is not all in the window it runs in is not replayable)."""
        order, windows = mark
        here = self._window_key()
        if self.order[:len(order)] != order or any(w != here for w in self.order[len(order):]):
            return None
        for w, c in self.windows.items():
            if w != here and c != windows.get(w, Counter()):
                return None
        before = windows.get(here, Counter())
        return Counter({k: v - before.get(k, 0) for k, v in self.windows.get(here, {}).items()
                        if v != before.get(k, 0)})

    def apply(self, delta: Counter) -> None:
        if delta:
            self._window().update(delta)

    # -- dispatch ------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        """Sort one op into its window's work (as a mode entered inside the tracker, or as the
        tracker's observer: either way after the tracker has counted the op's outputs)."""
        collective = func.namespace in COLLECTIVE_NAMESPACES
        if not collective and not launches_kernel(func):
            return
        if self._in_flight:
            self._settle(func)
        if collective:
            self._collective(func, args, kwargs)
        else:
            self._kernel(func, args, kwargs, out)

    def _settle(self, func) -> None:
        """End the wait of the torch ring's in-flight collectives that this op follows: torch's
        rotater waits for a step's exchange at the start of the next step, before that step's
        attention (``next_buffer``), and for its last one before the ring returns. The fake
        step cannot show the wait (under fake tensors ``_functional_collectives`` waits at
        once), so it is placed by the ring's structure: a collective stays in flight until the
        second attention kernel after it, or until an op runs outside torch's ring. Exact for a
        K/V exchange (issued before a step's kernel, waited before the next one's); a dK/dV
        exchange (issued after a step's kernel) is waited after the next step's kernel, and
        this counts beside it also the few memory-bound ops that follow that kernel (the
        gradients' accumulation, the next exchange's concatenation)."""
        if not _called_from(_TORCH_RING_FILE):
            self._in_flight.clear()
        elif _attention_op(func) is not None:
            for entry in self._in_flight:
                entry[2] += 1
            self._in_flight = [e for e in self._in_flight if e[2] < 2]

    def _collective(self, func, args, kwargs) -> None:
        call = describe_collective(func, args, kwargs)
        if call is None:
            return
        op = COLLECTIVE_OPS[call.op]
        fsdp, unit = (False, None) if op == "p2p" else _fsdp_unit()
        if fsdp:  # counted in its unit's window: the overlap rules place it from there
            mechanism, w = "fsdp", self._window(unit)
        else:
            if func.namespace == "_c10d_functional" and _called_from(_TORCH_RING_FILE):
                mechanism = "async"
            elif op == "p2p":  # the ring's K/V rotation runs beside the step's kernel; its
                # backward's dK/dV exchange is waited for before the next kernel: beside none
                mechanism = ("blocking" if _called_from("upipe/ring.py", ("_pass_on_gradients",))
                             else "p2p")
            elif _called_from("upipe/comm.py", ("_all_to_all_async",)):
                mechanism = "overlap"
            else:
                mechanism = "blocking"
            w = self._window()
        # A ring step ends when every rank has its next block: the ring moves in lockstep, so
        # each step waits for its slowest hop (across nodes if the ring spans them), not only
        # for this rank's send
        scope = self._scope(call.group, None if op == "p2p" else call.peer)
        key = (mechanism, op, scope)
        if mechanism == "async":  # its own key: the kernels it waits beside are its own too
            key += (self._issued,)
            self._in_flight.append([self._issued, self._window_key(), 0])
            self._issued += 1
        sent = call.sent
        if scope == "inter" and op == "all_to_all" and call.shares is None:
            # an all-to-all across nodes: each GPU has its own NIC, so only the bytes for
            # other nodes cross it; those for its node's peers cross NVLink at the same time
            # (``time_model``: the longer of the two). One with split sizes stays all on the
            # NIC: its other ranks' splits are not known here, and it ends with its slowest
            sent, local = self._across_and_within(call)
            w[("comm", mechanism, op, "node", *key[3:])] += local
        w[("comm", *key)] += sent
        if call.sent or op != "p2p":  # a ring step's send and receive are one transfer
            w[("comm_calls", *key)] += 1

    def _kernel(self, func, args, kwargs, out) -> None:
        ins = tensor_leaves((args, kwargs), [])
        outs = tensor_leaves(out, [])
        if not ins and not outs:
            return
        kinds = {self.tracker.kind(t) for t in ins + outs}
        if HOST in kinds:
            self._host_op(func, args, ins, outs, kinds)
            return
        w: Counter = Counter()
        w["kernels",] += 1
        attention = _attention_op(func)
        if attention is not None:
            self._attention(func, args, kwargs, attention, w)
        elif func in _MATMUL:
            i, j = _MATMUL[func]
            a, b = args[i], args[j]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            flops = flop_formula(func)(*args, **kwargs, out_val=out)
            w["matmul", DTYPE_NAMES.get(a.dtype, str(a.dtype)), (m, n, k)] += flops
            c = args[0] if i == 1 else None  # C of C + A @ B, full size (not a broadcast)
            if c is not None and c.numel() == out.numel() and 0 not in c.stride():
                w["memory",] += _nbytes([args[0]])
        else:
            w["memory",] += _nbytes(ins) + _nbytes(outs)
        self._window().update(w)
        for n, window, _ in self._in_flight:  # the kernels an in-flight collective runs beside
            cover = self.windows[window]
            for k, v in w.items():
                cover[("cover", n, *k)] += v

    def _attention(self, func, args, kwargs, attention, w: Counter) -> None:
        kernel, pass_, layout = attention
        b = _bound(func, args, kwargs)
        q = b.get("query", b.get("q"))
        k = b.get("key", b.get("k"))
        causal = bool(b.get("is_causal", b.get("causal", False)))
        if layout == "bhsd":
            bsz, h, s_q, d = q.shape
            s_k, h_kv = k.shape[2], k.shape[1]
        else:
            bsz, s_q, h, d = q.shape
            s_k, h_kv = k.shape[1], k.shape[2]
        full = f"{pass_}_causal" if causal else pass_
        # group: query heads per K/V head as the kernel receives them (1 where K/V were
        # repeated before the call); a kernel sharing K/V natively runs faster (profile.py)
        w["attention", kernel, DTYPE_NAMES.get(q.dtype, str(q.dtype)), full, d,
          (s_k, bsz * h, h // h_kv)] += attention_flops(bsz, h, s_q, s_k, d, full)

    def _host_op(self, func, args, ins, outs, kinds) -> None:
        """A copy between host and device (or an op on host tensors only, not priced: it
        writes its outputs' pages, ``_written``)."""
        if kinds <= {HOST, None}:
            self._write(outs)
            return
        w = self._window()
        if func is _aten.copy_.default:  # into its first argument
            direction = "d2h" if self.tracker.kind(args[0]) == HOST else "h2d"
            nbytes = _nbytes([args[0]])
            warm = direction == "d2h" and self._was_written(args[0])
            self._write([args[0]] if direction == "d2h" else [])
        else:  # a tensor made on the other side (clone, _to_copy): .to("cpu") is d2h
            direction = "d2h" if outs and self.tracker.kind(outs[0]) == HOST else "h2d"
            nbytes, warm = _nbytes(outs), False
            self._write(outs if direction == "d2h" else [])
        side = _called_from("upipe/host.py", ("write", "prefetch")) or on_side_stream()
        # DeepSpeed's FPDT pins its chunks' host buffers at every length (deepspeed/sequence/
        # fpdt_layer.py, SequenceChunk: pin_memory() of each, and of the dQ accumulators); the
        # portable stand-in cannot pin without CUDA, so the call site says it
        pinned = _called_from("deepspeed/sequence/fpdt_layer.py", (
            "__init__", "load_to_gpu", "overwrite_to_cpu"))  # SequenceChunk's
        flags = ("pinned",) if pinned else ("warm",) if warm else ()
        w[("copy", "side" if side else "sync", direction, *flags)] += nbytes

    def _write(self, tensors) -> None:
        """Note that ``tensors``' host pages have been written (the OS has mapped them)."""
        for p in (p for t in tensors for p in plain_tensors(t)):
            if torch._C._has_storage(p) and self.tracker.kind(p) == HOST:
                self._written.add(p.untyped_storage())

    def _was_written(self, t: torch.Tensor) -> bool:
        """Whether a host tensor's pages were written before: a pageable copy into them runs
        at the rate of mapped pages, not at the page faults' of a new tensor (measured on an
        H200: 18.18 GB/s against 1.84, results/gpu_costs_h200/kernels/host_copy.csv). The
        offload's pack copies into a new tensor each step; ``upipe.host.HostStore`` zeroes its
        accumulators on the host before it copies into them, and overwrites what it stored."""
        return all(torch._C._has_storage(p) and p.untyped_storage() in self._written
                   for p in plain_tensors(t))

