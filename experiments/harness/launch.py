"""Launch one cell in its own process group and turn whatever happens into a row.

``run_cell(cell)`` validates the cell (``invalid`` rows never start a process), spawns
``cell.world`` ranks (dp x nproc; gloo on CPU; NCCL with one GPU per rank when CUDA is
present; with ``shared_gpu`` gloo with every rank on one GPU), runs the cell's workload on
each (``measure.measure_cell``, or ``attention_layer.measure_attention``) and returns rank 0's
row. A fresh process group per cell means an OOM leaves no damaged allocator behind
(docs/conventions.md#one-process-group-per-cell). Outcomes (``experiments.config.Status``):

- ``ok``, or ``oom`` over a CPU budget (decided by the ranks together);
- ``oom``: a rank's CUDA allocator raised ``torch.OutOfMemoryError``. Nothing else is an OOM:
  a rank killed by a signal (SIGKILL from a user, a scheduler or the kernel's OOM killer: the
  launcher cannot tell which) or a CPU allocation failure is an ``error`` naming what
  happened, which ``--retry-failed`` runs again and a max-context search does not read as a
  limit;
- ``timeout``: the cell ran past ``timeout_s``; its ranks are killed;
- ``error``: anything else, with the failing rank's traceback as ``error``;
- ``skipped``: the method or its kernel cannot run on this machine (``unavailable_reason``, e.g.
  a CUDA-only adapter or kernel on CPU); nothing is launched;
- ``invalid``: a rule of the cell is broken, or its inputs cannot exist on this machine
  (``host_inputs_fit``); nothing is launched.

Under torchrun (``WORLD_SIZE`` set, ``dist`` initialised by the caller) cells run in that one
process group instead, one after another; a cell whose ``world`` (dp x nproc) differs from the
world size is ``skipped``. Multi-node runs go through torchrun
(docs/design.md#three-execution-modes-one-code-path). Every rank of a cell must run the same cell
(length, options): the launcher gives all its ranks the same one; under torchrun the caller must
(collectives between ranks that disagree fail inside the backend).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.config import (
    ERROR_TAIL_CHARS,
    PROCESS_GROUP_TIMEOUT_S,
    Cell,
    ModelConfig,
    Status,
    resolve_model,
)
from experiments.harness.attention_layer import measure_attention
from experiments.harness.measure import measure_cell
from experiments.harness.ranks import (
    enter_rank,
    exit_without_finalizing,
    free_port,
    join_draining,
    started_ranks,
    threads_per_rank,
)
from experiments.harness.train import TORCH_DTYPES
from experiments.provenance import provenance
from experiments.row import Row
from upipe.kernels import kernel_unavailable_reason, machine_auto_kernel
from upipe.registry import get_method

WORKLOADS = {"step": measure_cell, "attention": measure_attention}


def describe(cell: Cell, cfg: ModelConfig | None) -> Row:
    """The row's identity and config columns (flat, CSV-friendly); ``world_size`` is the job's
    dp x nproc ranks."""
    d = cell.to_dict()
    extra = d.pop("extra")
    d["overrides"] = ";".join(f"{k}={v}" for k, v in cell.overrides)
    d["cell_id"] = cell.cell_id()
    d["world_size"] = cell.world
    if cfg is not None:
        d |= {f"model_{k}": v for k, v in cfg.__dict__.items()}
    return d | extra


def unrun(cell: Cell, cfg: ModelConfig | None, status: str, error: str, mode: str) -> Row:
    """The row of a cell that did not run (invalid, skipped): its identity, why, and how it
    would have run (``mode``)."""
    return describe(cell, cfg) | {"status": status, "error": error, "mode": mode}


def host_inputs_fit(cell: Cell, cfg: ModelConfig) -> str | None:
    """Why the cell's inputs cannot exist on this machine, or None.

    Every rank draws its replica's full sequence's tokens and labels (int64, ``S`` each: the
    same data on every rank of a replica, sharded after) before anything else, so the ranks on
    this host need 16 B x S each of host memory at least; beyond the host's physical memory
    the ranks would only die allocating. The attention workload's inputs are the local
    (L, dim) activations.
    """
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: nothing to check against
        return None
    ranks_here = min(cell.world, int(os.environ.get("LOCAL_WORLD_SIZE", cell.world)))
    if cell.workload == "attention":
        need = 2 * cell.seq_len * cfg.dim * 4 // cell.nproc * ranks_here
    else:
        need = 16 * cell.seq_len * ranks_here
    if need > physical:
        return (f"seq_len ({cell.seq_len}) needs at least {need / 2**30:.1f} GiB of inputs on "
                f"this host's {ranks_here} rank(s), more than its {physical / 2**30:.1f} GiB of "
                "memory")
    return None


def shared_gpu_refusal(cell: Cell) -> str | None:
    """Why ``cell`` cannot run with every rank on one GPU (``--shared-gpu``), or None: its
    ranks would talk through gloo, which carries all-to-all, all-gather, reduce-scatter,
    all-reduce and broadcast on CUDA tensors but no P2P, so a method that sends K/V by P2P
    (``p2p_exchange``, a hybrid's ring axis) is refused; and there must be a GPU."""
    cls = get_method(cell.method)
    why = (cls.p2p_exchange if cls.p2p_exchange is not None else
           "its ring axis moves K/V by batch_isend_irecv (upipe.ring)"
           if cell.ring_degree > 1 else None)
    if why is not None:
        return (f"--shared-gpu: method {cell.method!r} (ring degree {cell.ring_degree}) cannot "
                f"run with its ranks on one GPU: {why}, and gloo carries no P2P on CUDA tensors "
                "(it does all-to-all, all-gather, reduce-scatter, all-reduce, broadcast); run "
                "it on CPU ranks, or with NCCL and one GPU per rank")
    if not torch.cuda.is_available():
        return ("--shared-gpu puts every rank on one CUDA GPU, and torch sees none here "
                "(torch.cuda.is_available() is False); without it the ranks run on the CPU")
    return None


def launch_refusal(cell: Cell, shared_gpu: bool = False) -> str | None:
    """Why ``cell`` cannot be launched here (with ``shared_gpu``: with every rank on one GPU),
    or None: ``shared_gpu_refusal``, then ``unavailable_reason`` on the device its ranks use."""
    if shared_gpu:
        return shared_gpu_refusal(cell) or unavailable_reason(cell, "cuda")
    return unavailable_reason(cell)


def _rank_main(rank: int, cell: Cell, cfg: ModelConfig, port: int, threads: int, progress: bool,
               results, shared_gpu: bool = False) -> None:
    enter_rank(threads)
    backend = "gloo"
    if shared_gpu:  # every rank on the first GPU; gloo copies CUDA tensors through the host
        torch.cuda.set_device(0)
    elif torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        backend = "nccl"
    else:  # DeepSpeed (tiled MLP, ds-ulysses) would probe for accelerators and warn
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cell.world,
                            timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    try:
        row = WORKLOADS[cell.workload](cell, cfg, progress=progress)
        if rank == 0:
            results.put(row | provenance())  # a pipe write: delivered when put returns
        dist.barrier()  # every rank is past its last collective
    finally:
        dist.destroy_process_group()
    exit_without_finalizing(0)


def _killed(e: mp.ProcessExitedException) -> dict:
    """A rank that died without a Python exception: killed by a signal, or exited by itself."""
    what = (f"rank {e.error_index} was killed by {e.signal_name}" if e.signal_name
            else f"rank {e.error_index} exited with code {e.exit_code}")
    hint = (" (from outside the cell: a user, a scheduler, or the kernel's OOM killer, which "
            "the launcher cannot tell apart; not a measured OOM)"
            if e.signal_name == "SIGKILL" else "")
    return {"status": Status.ERROR, "error": f"{what}{hint}: {e}"}


def _raised(text: str) -> dict:
    """A rank raised: its traceback is the message. Only the CUDA allocator's own error is an
    OOM (a CPU allocation failure is an error: on CPU only the budget decides OOMs)."""
    oom = "torch.OutOfMemoryError" in text or "CUDA out of memory" in text
    return {"status": Status.OOM if oom else Status.ERROR, "error": text[-ERROR_TAIL_CHARS:]}


def _spawn(cell: Cell, cfg: ModelConfig, timeout_s: float | None, threads: int,
           progress: bool, shared_gpu: bool = False) -> dict:
    results = mp.get_context("spawn").SimpleQueue()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with started_ranks(_rank_main, (cell, cfg, free_port(), threads, progress, results,
                                    shared_gpu), cell.world) as pc:
        try:
            # read while the ranks run: a row over a pipe's 64 KiB (thousands of --iters) kept
            # rank 0 in its put and the others at their barrier until the timeout
            done, got = join_draining(pc, deadline, results)
            if not done:
                return {"status": Status.TIMEOUT, "error": f"cell ran past timeout_s={timeout_s}"}
        except mp.ProcessExitedException as e:
            return _killed(e)
        except mp.ProcessRaisedException as e:
            return _raised(str(e))
    if not got:
        return {"status": Status.ERROR, "error": "rank 0 exited without a result"}
    return got[0]


def disagreement(cell: Cell) -> str | None:
    """Under torchrun, which cell fields the ranks disagree on (every rank was given its own
    command line), or None. One small all-gather, before the cell's first collective: ranks
    that disagree on a length would otherwise fail inside the backend without naming it."""
    cells = [None] * dist.get_world_size()
    dist.all_gather_object(cells, cell.to_dict())
    fields = sorted({k for c in cells for k in c if c[k] != cells[0][k]})
    if not fields:
        return None
    values = "; ".join(f"{k}: {[c[k] for c in cells]}" for k in fields)
    return f"the ranks were given different cells (every rank must run the same one): {values}"


def _in_process(cell: Cell, cfg: ModelConfig, progress: bool) -> dict:
    world = dist.get_world_size()
    if world != cell.world:
        return {"status": Status.SKIPPED,
                "error": f"dp x nproc ({cell.dp} x {cell.nproc}) != torchrun world {world}"}
    differ = disagreement(cell)
    if differ is not None:
        return {"status": Status.INVALID, "error": differ}
    try:
        return WORKLOADS[cell.workload](cell, cfg, progress=progress) | provenance()
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"status": Status.OOM, "error": traceback.format_exc()[-ERROR_TAIL_CHARS:]}
    except Exception:
        return {"status": Status.ERROR, "error": traceback.format_exc()[-ERROR_TAIL_CHARS:]}


def unavailable_reason(cell: Cell, device_type: str | None = None) -> str | None:
    """Why the cell cannot run on this machine, or None; decided before anything is launched:
    by the method class (e.g. a CUDA-only adapter on a CPU machine), then by the kernel (a
    CUDA-only kernel, flash-attn, fa3 or cudnn, on a CPU machine, without its library, or in
    a dtype or head dim it refuses; a kernel the method does not take). ``device_type``: where
    its ranks run (default: CUDA when torch sees a GPU)."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    reason = get_method(cell.method).unavailable_reason(device_type)
    if reason is None:
        reason = method_kernel_refusal(cell)
    if reason is None:
        reason = kernel_unavailable_reason(cell.kernel, device_type, cell.dtype,
                                           _head_dim(cell))
    return reason


def _head_dim(cell: Cell) -> int | None:
    try:
        return resolve_model(cell.model, cell.overrides).head_dim
    except ValueError:  # an invalid model: the cell's validation says why
        return None


def method_kernel_refusal(cell: Cell) -> str | None:
    """Why the cell's method does not run the kernel ``cudnn`` it names (a method calling an
    attention library itself, ``own_kernel``), or None. Only ``cudnn`` is refused: a row of
    such a method records the kernel that really ran (``kernel_ran``) whatever it names."""
    own = get_method(cell.method).own_kernel
    if own is not None and cell.kernel == "cudnn":
        return f"method {cell.method!r} does not take kernel 'cudnn': {own[1]}"
    return None


def kernel_ran(cell: Cell, cfg: ModelConfig, device_type: str,
               auto: Callable[[torch.Tensor], str] | None = None) -> str:
    """The attention kernel a cell's step runs on ``device_type`` (never ``"auto"``): a method's
    own library's on CUDA (``own_kernel``, unless the cell names one of its
    ``own_kernel_choices``), else the kernel the cell names, ``"auto"``
    resolved as ``upipe.kernels.resolve_kernel`` resolves it there (``auto``: for a query
    (B, S, H, D); default: this machine's choice)."""
    cls = get_method(cell.method)
    if cls.own_kernel is not None and device_type == "cuda":
        return cell.kernel if cell.kernel in cls.own_kernel_choices else cls.own_kernel[0]
    if cell.kernel != "auto":
        return cell.kernel
    q = torch.empty(1, 1, cfg.n_heads, cfg.head_dim, dtype=TORCH_DTYPES[cell.dtype],
                    device="meta")
    if auto is not None:
        return auto(q)
    if device_type != "cuda":
        return "sdpa"
    return machine_auto_kernel(torch.cuda.current_device(), q.dtype, cfg.head_dim)


def run_cell(cell: Cell, timeout_s: float | None = None, progress: bool = False,
             shared_gpu: bool = False) -> Row:
    """Run ``cell`` once; always returns a row (see the module docstring for the statuses),
    with ``mode`` ``measured`` (``experiments.emulation.emulate_cell``'s rows say
    ``emulated``). ``progress``: rank 0 prints a line per step on stderr. ``shared_gpu``: every
    rank on one GPU with gloo (``shared_gpu_refusal`` says what cannot); the row says so
    (``shared_gpu``), and its times are no speed result: the ranks take turns on one GPU and
    their collectives go through host memory."""
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout must be positive (seconds per launch), got {timeout_s}")
    try:
        cfg = cell.validate()
    except ValueError as e:
        return unrun(cell, None, Status.INVALID, str(e), "measured")
    torchrun = dist.is_initialized()
    reason = launch_refusal(cell, shared_gpu)
    if shared_gpu and torchrun and reason is None:
        reason = ("--shared-gpu starts the ranks itself; under torchrun each rank already has "
                  "its device and backend")
    if reason is not None:  # nothing to launch: a row saying why
        return unrun(cell, cfg, Status.SKIPPED, reason, "measured") | (
            {"shared_gpu": True} if shared_gpu else {})
    too_big = host_inputs_fit(cell, cfg)
    if too_big is not None:
        return unrun(cell, cfg, Status.INVALID, too_big, "measured")
    threads = threads_per_rank(cell.world)
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    res = (_in_process(cell, cfg, progress) if torchrun
           else _spawn(cell, cfg, timeout_s, threads, progress, shared_gpu))
    res.setdefault("error", "")
    # load averages flag other work on the machine during the cell (timing noise)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    # provenance on every launched row: a timeout, a killed or raising rank return no row of
    # their own, and rank 0's (on success) is this machine's, with the same revision
    return describe(cell, cfg) | provenance() | res | {
        "kernel_ran": kernel_ran(cell, cfg, device_type),
        "mode": "measured", "wall_s": round(time.monotonic() - t0, 2), "load_1m_start": load0,
        "load_1m_end": os.getloadavg()[0], "threads_per_rank": threads,
        "launcher": "torchrun" if torchrun else "spawn"} | ({"shared_gpu": True} if shared_gpu
                                                            else {})
