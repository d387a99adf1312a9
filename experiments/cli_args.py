"""The command line's flags and how they resolve into a ``Cell``, the emulated ``Hardware`` and
a ``SearchSpec`` (``experiments.cli`` holds the commands).

Every resolution checks the flags together and raises ValueError naming the flag and the rule
(the CLI turns it into exit status 2): ``--world`` is the job's ``--dp`` x ``--nproc`` ranks
(``--nproc`` by another name without ``--dp``), ``--mesh UxR`` sets both the CP degree (U x R)
and the ring degree R, the hardware flags apply to emulation only,
and a search's granularity is nproc x block. ``--stack`` defaults to the paper's stack for the
method (``config.paper_stack``); emulated cells default to the paper's bf16 on one 8-GPU node.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

from experiments.config import (
    DEFAULT_RESERVE_GIB,
    DEFAULT_TIMEOUT_S,
    DTYPES,
    EMULATED_GRANULARITY,
    EMULATED_START,
    METHOD_RESERVE_GIB,
    PRESETS,
    STACKS,
    WORKLOADS,
    Cell,
    Hardware,
    SearchSpec,
    format_size,
    hf_overrides,
    paper_stack,
    parse_overrides,
    parse_size,
)
from experiments.config.options import default, every_option
from experiments.runner.plan import default_workers
from experiments.runner.plan_spec import DEFAULT_STACKS, PlanSpec
from experiments.timing.profile import (
    ProfileError,
    load_profile,
    profile_for,
    shipped_profiles,
)
from upipe.kernels import KERNELS
from upipe.options import MethodOption

# emulation defaults: one node of the paper (8x H100 80 GB, DGX H100 host RAM)
EMULATED_WORLD = 8
# Hardware field -> the flag that sets it (validation messages name the flag)
HARDWARE_FLAGS = {"gpu_mem_gib": "--gpu-mem", "host_mem_gib": "--host-mem",
                  "gpus_per_node": "--gpus-per-node", "reserve_gib": "--reserve",
                  "device": "--emulate-device", "profile": "--hardware"}
# PlanSpec field -> plan's flag
PLAN_FLAGS = {"gpus": "--gpus", "dp": "--dp", "seq_len": "--seq-len", "dtype": "--dtype",
              "kernel": "--kernel", "methods": "--methods", "stacks": "--stacks",
              "ring_degrees": "--ring-degrees"}


def named_as_flags(msg: str, flags: dict[str, str]) -> str:
    """A validation message with the fields it reports named as the flags that set them: the
    field it is about (its first word: "gpu_mem_gib must be positive") and a field it cites
    with its value ("below gpu_mem_gib (79.65)"). Nothing else is rewritten, so a field's name
    in prose ("a profile name"), a file name or a path stays as it is."""
    names = "|".join(map(re.escape, flags))
    cited = rf"(?<![\w./\\'\"-])({names})(?= \()"
    return re.sub(rf"^({names})\b|{cited}", lambda m: flags[m[1] or m[2]], msg)


def size(text: str) -> int:
    """argparse type for token counts: '128K', '1M', '131072'."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _number(text: str, convert, what: str, ok, rule: str):
    """``convert(text)`` for argparse, refused unless ``ok(value)`` (``rule`` says why)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (ranks, steps of a search)."""
    return _number(text, int, "an integer", lambda v: v >= 1, ">= 1")


def non_negative_int(text: str) -> int:
    """argparse type for step counts that may be 0 (warm-up, timed steps)."""
    return _number(text, int, "an integer", lambda v: v >= 0, ">= 0")


def out_dir(text: str) -> Path:
    """argparse type for a folder results are written into: a directory, or a path where one
    can be made; a file there or in the way above it is refused now, not after the work."""
    path = Path(text)
    blocker = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise argparse.ArgumentTypeError(f"{blocker} is a file, not a directory")
    if blocker is not None and not os.access(blocker, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{blocker} is not writable by this user: no results "
                                         "can be written there")
    return path


def seconds(text: str) -> float:
    """argparse type for a time limit: a positive number of seconds."""
    return _number(text, float, "a number of seconds", lambda v: v > 0, "positive")


def _shown_default(method: str, opt: MethodOption) -> str:
    """What ``method`` does when option ``opt`` is not set, for a help text: its
    constructor's default (read from the code, so the help cannot drift from it), or the
    declaration's ``unset`` where that default is None."""
    value = default(method, opt.name)
    if value is None:
        return opt.unset or "unset"
    if opt.kind is bool:
        return "on" if value else "off"
    return format_size(value) if opt.tokens else str(value)


def _default_text(shown: dict[str, str]) -> str:
    """The methods' defaults for a help text: one value when they agree, else per method."""
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return ", ".join(f"{m} {v}" for m, v in shown.items())


def add_option_args(p: argparse.ArgumentParser) -> None:
    """One flag per option the registered methods declare (``--heads-per-stage``,
    ``--chunk-size``, ``--overlap/--no-overlap``), its help built from their declarations: a
    method's new option gets its flag without a line here."""
    for name, by in every_option().items():
        helps: dict[str, list[str]] = {}
        for method, opt in by.items():
            helps.setdefault(opt.help, []).append(method)
        shown = {m: _shown_default(m, opt) for m, opt in by.items()}
        text = ("; ".join(f"{', '.join(ms)}: {h}" for h, ms in helps.items())
                + f" (default: {_default_text(shown)})")
        opt, flag = next(iter(by.values())), "--" + name.replace("_", "-")
        if opt.kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            p.add_argument(flag, type=size if opt.tokens else opt.kind, default=None,
                           choices=opt.choices or None, help=text)


def add_progress_arg(p: argparse.ArgumentParser, has_json: bool = True) -> None:
    """--no-progress (``has_json``: the verb has a --json, which prints no progress either)."""
    p.add_argument("--no-progress", action="store_true",
                   help="print no progress on stderr"
                        + (" (--json prints none either)" if has_json else ""))


def add_cell_args(p: argparse.ArgumentParser, *, dtype: str | None = "fp32",
                  nproc_default: str = "the torchrun world, else 4",
                  measured: bool = True, iters_default: int = 2) -> None:
    """The cell's flags; ``measured`` adds those of a real launch (steps, timeout; the verb's
    default timed steps ``iters_default``)."""
    p.add_argument("--method", required=True, help="registry name (upipe-bench list methods)")
    p.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--seq-len", type=size, default=4096, help="global tokens: 131072, 128K, 1M")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help=f"ranks per CP group = the CP degree (default: {nproc_default}, over "
                        "--dp)")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel replicas, each training its own sequence; the job has "
                        "dp x nproc ranks and FSDP2 shards over all of them (default 1)")
    p.add_argument("--stack", default=None,
                   help=f"memory stack: {', '.join(STACKS)} (default: the paper's for the "
                        "method: torchtitan for torch-cp, megatron-ds for ds-fpdt, else alst)")
    add_option_args(p)
    p.add_argument("--ring-degree", type=int, default=None,
                   help="hybrids (usp, upipe): ring axis of a (ring, ulysses) mesh; "
                        "Ulysses degree = nproc / ring degree (default 1)")
    p.add_argument("--doc-len", type=size, default=None,
                   help="packed documents: tokens per document (4K); the sequence is cut into "
                        "seq-len // doc-len documents, the last one holding the remainder, and "
                        "attention, RoPE positions and labels stay inside each (default: one "
                        "unpacked sequence; torch-cp, rfa-zigzag and ds-fpdt refuse it)")
    p.add_argument("--keep-blocks", type=positive_int, default=None, metavar="K",
                   help="with a stack that keeps the attention (alst-attn, alst-attn-host, "
                        "long-attn-host) or whole blocks (alst-block): keep it in the last K "
                        "blocks only, the others recompute it (default: every block)")
    p.add_argument("--global-rope-table", action="store_true",
                   help="hold the paper's TorchTitan RoPE table on every rank: every position "
                        "of the global sequence, 512 bytes a token at head dim 128, as the "
                        "paper's runs of every method but ds-fpdt kept it (memory only)")
    dtype_default = dtype or "fp32; with --emulate bf16, the paper's"
    p.add_argument("--dtype", default=dtype,
                   help=f"one of {', '.join(DTYPES)} (default {dtype_default})")
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="attention kernel (default auto: the fastest this machine runs, or on "
                        "an emulated GPU the fastest PyTorch kernel there: cudnn on Hopper in "
                        "bf16/fp16, else sdpa; rows record it as kernel_ran)")
    if measured:  # the emulator runs the training step only
        p.add_argument("--workload", default=None, choices=WORKLOADS,
                       help="step: one training step of the model (default); attention: one "
                            "attention layer's forward and backward, the model's heads and "
                            "width")
    p.add_argument("--budget-mib", type=float, default=None,
                   help="per-rank device budget (CPU: tracked bytes; GPU: allocator limit; "
                        "emulated: replaces --gpu-mem less --reserve)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="model field override, repeatable (e.g. n_layers=2)")
    if measured:
        # None when not given, so that max-context --emulate can refuse them (LAUNCH_FLAGS)
        p.add_argument("--warmup", type=non_negative_int, default=None,
                       help="untimed steps before the memory step and the timed ones (default 1)")
        p.add_argument("--iters", type=non_negative_int, default=None,
                       help=f"timed steps (default {iters_default}; 0: memory only)")
        p.set_defaults(iters_default=iters_default)
        p.add_argument("--timeout", type=seconds, default=None,
                       help=f"seconds per launch (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout and no progress")
    add_progress_arg(p)


def add_world_args(p: argparse.ArgumentParser) -> None:
    """--world and --mesh, resolved with --nproc and --ring-degree by ``world_from_args``."""
    p.add_argument("--world", type=positive_int, default=None, metavar="N",
                   help="the (emulated) world size: dp x nproc (--nproc without --dp)")
    p.add_argument("--mesh", default=None, metavar="UxR",
                   help="Ulysses degree x ring degree, e.g. 8x2: nproc 16 with ring degree 2")


def add_hardware_args(p: argparse.ArgumentParser, *, required: str = "") -> None:
    """The emulated hardware's flags; ``required`` names the flag they need (max-context's
    --emulate). Defaults are None here and resolved in ``hardware_from_args`` so that a flag given
    without ``required`` is an error rather than silently ignored."""
    g = p.add_argument_group("emulated hardware" + (f" (with {required})" if required else ""))
    g.add_argument("--gpu-mem", type=float, default=None, metavar="GiB",
                   help="device memory per GPU (default 79.65: an H100 80 GB as CUDA sees it)")
    g.add_argument("--host-mem", type=float, default=None, metavar="GiB",
                   help="host RAM per node, shared by its ranks (default 2048: DGX H100)")
    g.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="ranks per node; a rank's host budget is the node's RAM over them "
                        "(default 8)")
    g.add_argument("--reserve", type=float, default=None, metavar="GiB",
                   help="device memory kept off the budget: the caching allocator's reserve "
                        "beyond its tensors (default: measured on an H100, "
                        f"{DEFAULT_RESERVE_GIB:g}, " + ", ".join(
                            f"{m} {r:g}" for m, r in METHOD_RESERVE_GIB.items())
                        + "; 0 with --emulate-device cpu)")
    g.add_argument("--exact", action="store_true", default=None,
                   help="emulate the target size itself instead of predicting it from the fit "
                        "of small exact emulations (slower at paper scale)")
    g.add_argument("--hardware", default=None, metavar="NAME|PATH.json",
                   help="hardware profile of the time model: "
                        f"{', '.join(shipped_profiles())} or a profile written by "
                        "'upipe-bench calibrate' (default h100-sxm on an emulated cuda device; "
                        "its device memory is the default --gpu-mem)")
    g.add_argument("--emulate-device", choices=["cuda", "cpu"], default=None,
                   help="kernels and allocator emulated: cuda (default), or cpu (what a gloo "
                        "run's tracker measures)")


def hardware_from_args(a: argparse.Namespace, world: int | None = None, *,
                       enabled: bool = True, why: str = "") -> Hardware | None:
    """The emulated ``Hardware`` from the flags (validated against the emulated ``world``,
    errors naming the flag); None when emulation is off, in which case no hardware flag may be
    given."""
    given = {"--gpu-mem": a.gpu_mem, "--host-mem": a.host_mem,
             "--gpus-per-node": a.gpus_per_node, "--reserve": a.reserve, "--exact": a.exact,
             "--emulate-device": a.emulate_device, "--hardware": a.hardware}
    if not enabled:
        extra = [flag for flag, v in given.items() if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} appl{'ies' if len(extra) == 1 else 'y'} "
                             f"to {why} only")
        return None
    values = {"gpu_mem_gib": a.gpu_mem, "host_mem_gib": a.host_mem,
              "gpus_per_node": a.gpus_per_node, "reserve_gib": a.reserve,
              "device": a.emulate_device, "profile": a.hardware}
    try:
        if a.hardware and a.emulate_device is None:  # "" is refused by validate, by name
            # the profile's device: a CPU calibration emulates a cpu device without being told
            values["device"] = load_profile(a.hardware).device
        hw = dataclasses.replace(Hardware(), **{k: v for k, v in values.items() if v is not None})
        hw.validate(world)
        profile = profile_for(hw)
        if a.hardware is not None and a.gpu_mem is None:  # the profiled device's memory
            hw = dataclasses.replace(hw, **_profiled_memory(profile, hw, world, a.host_mem))
            hw.validate(world)
    except ProfileError as e:  # the profile file's own fault: its path and its JSON fields
        raise ValueError(f"--hardware: {e}") from None
    except ValueError as e:
        raise ValueError(named_as_flags(str(e), HARDWARE_FLAGS)) from None
    return hw


def _profiled_memory(profile, hw: Hardware, world: int | None, host_mem: float | None) -> dict:
    """``Hardware`` fields from a profile's device memory: a GPU's is each rank's; a CPU
    calibration's is the host's physical memory, which the ranks on the host share (each gets
    its part; it gave every rank all of it) and which is also the host memory offload uses,
    unless ``--host-mem`` says otherwise. A rank's device and host bytes then come from one
    memory that each budget counts in full, so a cell near both budgets may not fit."""
    if profile.device != "cpu":
        return {"gpu_mem_gib": profile.gpu_mem_gib}
    ranks = min(world or hw.gpus_per_node, hw.gpus_per_node)
    return {"gpu_mem_gib": profile.gpu_mem_gib / ranks,
            **({} if host_mem is not None else {"host_mem_gib": profile.gpu_mem_gib})}


def parse_mesh(text: str) -> tuple[int, int]:
    """'8x2' -> (8, 2): Ulysses degree, ring degree."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--mesh must be UxR, the Ulysses degree x the ring degree, both >= 1 "
                         f"(e.g. 8x2: 16 ranks, ring degree 2), got {text!r}")
    return int(m[1]), int(m[2])


def world_from_args(a: argparse.Namespace, default_world: int) -> tuple[int, int]:
    """(nproc, ring_degree) from --nproc, --world, --mesh, --ring-degree and --dp, which must
    agree: --world is the job's dp x nproc ranks (--nproc by another name at --dp 1), --mesh UxR
    is nproc U*R with ring degree R; given none of them, nproc is ``default_world`` over dp."""
    nproc, ring = a.nproc, a.ring_degree
    world, mesh = getattr(a, "world", None), getattr(a, "mesh", None)
    dp = getattr(a, "dp", None) or 1
    if world is not None:
        if world < 1:
            raise ValueError(f"--world must be >= 1, got {world}")
        if world % dp or nproc is not None and nproc * dp != world:
            raise ValueError(f"--world ({world}) must be --dp x --nproc ({dp} x "
                             f"{'?' if nproc is None else nproc}); they must agree, give two")
        nproc = world // dp
    if mesh is not None:
        u, r = parse_mesh(mesh)
        if nproc is not None and nproc != u * r:
            raise ValueError(f"--mesh {mesh} is {u * r} ranks (Ulysses {u} x ring {r}) but "
                             f"--world/--nproc is {nproc}; they must agree")
        if ring is not None and ring != r:
            raise ValueError(f"--mesh {mesh} has ring degree {r} but --ring-degree is {ring}; "
                             "they must agree")
        nproc, ring = u * r, r
    if nproc is None:
        if default_world % dp:
            raise ValueError(f"--dp ({dp}) must divide the default world size "
                             f"({default_world}); give --nproc or --world")
        nproc = default_world // dp
    return nproc, (1 if ring is None else ring)


#: flags of a real launch only -> their value when not given
LAUNCH_FLAGS = {"warmup": 1, "iters": 2, "timeout": DEFAULT_TIMEOUT_S, "workload": "step"}


def launch_flag(a: argparse.Namespace, name: str):
    """A real launch's flag (``LAUNCH_FLAGS``): its value, or when not given the verb's
    default (``<name>_default``, as ``add_cell_args`` sets it), else the flag's."""
    value = getattr(a, name, None)
    return getattr(a, f"{name}_default", LAUNCH_FLAGS[name]) if value is None else value


def launch_flags_given(a: argparse.Namespace) -> list[str]:
    """The real-launch flags given on the command line (as flags), for a verb that emulates."""
    return [f"--{n}" for n in LAUNCH_FLAGS if getattr(a, n, None) is not None]


def cell_from_args(a: argparse.Namespace, *, emulated: bool = False,
                   validate: bool = True) -> Cell:
    """The cell the flags describe, validated (``validate=False``: a search's, which
    ``search_from_args`` validates at the length it runs). Emulated cells default to the
    paper's setting (bf16, one 8-GPU node); real ones to fp32 on the torchrun world, else 4
    ranks."""
    default_world = EMULATED_WORLD if emulated else int(os.environ.get("WORLD_SIZE", 4))
    nproc, ring_degree = world_from_args(a, default_world)
    cell = Cell(method=a.method, model=a.model, seq_len=a.seq_len, nproc=nproc,
                stack=a.stack or paper_stack(a.method),
                options={name: getattr(a, name, None) for name in every_option()},
                ring_degree=ring_degree, doc_len=a.doc_len,
                keep_blocks=getattr(a, "keep_blocks", None),
                global_rope_table=getattr(a, "global_rope_table", False),
                dtype=a.dtype or ("bf16" if emulated else "fp32"),
                kernel=a.kernel, overrides=parse_overrides(a.override),
                budget_mib=a.budget_mib, warmup=launch_flag(a, "warmup"),
                iters=launch_flag(a, "iters"), workload=launch_flag(a, "workload"), dp=a.dp or 1)
    if validate:
        cell.validate()
    return cell


def search_from_args(a: argparse.Namespace, *, emulate: bool) -> tuple[Cell, SearchSpec]:
    """max-context's first cell and its SearchSpec. The cell is at the search's first length
    (--start) and validated there, not at --seq-len: that is only a real search's default start
    (an emulated one ignores it), and a rule on the length (--doc-len at most the length, the
    method's own) holds or not at the lengths the search runs, not at an unused one."""
    cell = cell_from_args(a, emulated=emulate, validate=False)
    spec = search_spec_from_args(a, cell, emulate)
    cell = dataclasses.replace(cell, seq_len=spec.start)
    try:
        cell.validate()
    except ValueError as e:
        raise ValueError(f"{e} (max-context checks its cell at the search's first length, "
                         f"--start {cell.seq_len})") from None
    return cell, spec


def search_spec_from_args(a: argparse.Namespace, cell: Cell, emulate: bool) -> SearchSpec:
    """The search's SearchSpec from --start, --block, --granularity and --limit.

    Granularity (global tokens between the last passing and the first failing length) is
    nproc * block: give either. Real searches default to --block 512 and start at --seq-len;
    emulated ones to a 64K granularity from 1M tokens (rounded to the granularity)."""
    if a.granularity is not None:
        if a.granularity < 1 or a.granularity % cell.nproc:
            raise ValueError(f"--granularity ({a.granularity}) must be a positive multiple of "
                             f"the CP degree, nproc ({cell.nproc})")
        block = a.granularity // cell.nproc
        if a.block is not None and a.block != block:
            raise ValueError(f"--block ({a.block}) and --granularity ({a.granularity}) disagree:"
                             f" granularity = nproc ({cell.nproc}) * block; give one")
    elif a.block is not None:
        block = a.block
    elif emulate:
        if EMULATED_GRANULARITY % cell.nproc:
            raise ValueError(f"the default --granularity ({format_size(EMULATED_GRANULARITY)}) "
                             f"must be a multiple of the CP degree, nproc ({cell.nproc}); give "
                             "--granularity")
        block = EMULATED_GRANULARITY // cell.nproc
    else:
        block = 512
    gran = cell.nproc * block
    if a.start is not None:
        start = a.start
    elif emulate:
        start = max(gran, EMULATED_START // gran * gran)
    else:
        start = cell.seq_len
    spec = SearchSpec(start=start, block=block, limit=a.limit)
    try:
        spec.validate(cell.nproc)
    except ValueError as e:
        raise ValueError(str(e).replace("search.", "--")) from None
    return spec


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """``plan``'s flags (the hardware flags are added beside them)."""
    p.add_argument("--model", required=True, metavar="PRESET|config.json",
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json "
                        "(Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs in the job")
    p.add_argument("--dp", type=positive_int, default=1,
                   help="data-parallel replicas, each training its own sequence: the CP degree "
                        "is --gpus / --dp (default 1)")
    p.add_argument("--seq-len", type=size, required=True, help="global tokens per step: 4M")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, help="default bf16")
    p.add_argument("--kernel", default="auto", choices=KERNELS,
                   help="attention kernel (default auto: the fastest PyTorch kernel on the "
                        "profile's GPU, cudnn on Hopper in bf16/fp16, else sdpa; the paper ran "
                        "fa3)")
    p.add_argument("--methods", default=None, metavar="A,B",
                   help="only these methods, each named once (default: every registered "
                        "method)")
    p.add_argument("--stacks", default=None, metavar="A,B",
                   help=f"only these stacks, each named once, of {', '.join(STACKS)} (default: "
                        f"{', '.join(DEFAULT_STACKS)})")
    p.add_argument("--ring-degrees", default=None, metavar="1,2",
                   help="only these ring degrees, each named once, of the hybrid methods' (ulysses "
                        "x ring) meshes, "
                        "each a divisor of the CP degree (default: every divisor; 1 is the plain "
                        "Ulysses mesh). Methods without a mesh are planned as ever")
    p.add_argument("--workers", type=positive_int, default=None,
                   help="emulations run at once, one process each (default: one per CPU this "
                        f"process may use, {default_workers()} here)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_progress_arg(p)


def _names(text: str | None, flag: str) -> tuple[str, ...] | None:
    """``A,B`` -> ("A", "B"); None when not given (the default: all). Naming none is refused:
    an empty list would otherwise read as not given, and plan everything."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"{flag} must name at least one, separated by commas, got {text!r} "
                         "(leave it out for all)")
    return names


def _ring_degrees(text: str | None) -> tuple[int, ...] | None:
    """``--ring-degrees 1,2`` -> (1, 2); None when not given."""
    names = _names(text, "--ring-degrees")
    if names is None:
        return None
    try:
        return tuple(int(n) for n in names)
    except ValueError:
        raise ValueError(f"--ring-degrees must be integers separated by commas, got {text!r}"
                         ) from None


def plan_spec_from_args(a: argparse.Namespace) -> PlanSpec:
    """The planning question the flags ask, validated (a config.json is read into overrides)."""
    model, overrides, label = a.model, (), a.model
    if a.model not in PRESETS:
        if not (a.model.endswith(".json") or Path(a.model).is_file()):
            raise ValueError(f"--model must be a preset ({', '.join(PRESETS)}) or a Hugging "
                             f"Face config.json, got {a.model!r}")
        model, overrides = hf_overrides(a.model)
    spec = PlanSpec(model=model, overrides=overrides, gpus=a.gpus, dp=a.dp, seq_len=a.seq_len,
                    dtype=a.dtype, kernel=a.kernel, methods=_names(a.methods, "--methods"),
                    stacks=_names(a.stacks, "--stacks") or DEFAULT_STACKS, label=label,
                    ring_degrees=_ring_degrees(a.ring_degrees))
    try:
        spec.validate()
    except ValueError as e:
        raise ValueError(named_as_flags(str(e), PLAN_FLAGS)) from None
    return spec
