"""Hardware profiles for the time model (docs/design.md#the-time-model): rates as data, each with
its source.

A profile is a JSON file: the shipped ones in ``experiments/timing/profiles/`` (named by file
stem: ``h100-sxm``, ``h200``, ``a100-80gb``), or one written by ``upipe-bench calibrate``
(selected by path). Every number is a *constant*: an object ``{"value": ..., "source": "..."}``
whose source names where the value comes from (a datasheet, a paper's figure, an issue thread
with a measurement, or ``upipe-bench calibrate`` on a named machine). A number outside a
constant, or a constant without a source, is refused on load.

Schema (``value`` of each constant)::

    name, description                  strings (not constants)
    device                             "cuda" | "cpu" (the kernel paths the rates are for)
    compute_capability (optional)      "<major>.<minor>": the GPU's CUDA compute capability
    gpu_mem_gib                        device memory visible to the allocator, GiB
    side_streams                       bool: copies/collectives on side streams run beside
                                       compute (CUDA streams); False: everything is serial
    peak_flops.<dtype>                 dense matmul peak, FLOP/s: the MFU denominator
    matmul.<dtype>                     [[x, FLOP/s], ...], x = (m n k)^(1/3) of the product:
                                       the side of the square product of the same work
                                       (the shipped tables are measured on N x N x N
                                       products; calibrate's on (M x x) @ (x x x) ones, M =
                                       max(matmul_m, x), keyed by the cube root of their work)
    matmul_narrow.<dtype> (optional)   {"out": [[w, FLOP/s], ...], "inner": [[w, FLOP/s], ...]}:
                                       the rate a long product reaches when its output's narrow
                                       side (min(m, n): a stage's few heads) or its inner
                                       dimension k is only w wide; it caps the square rate for
                                       widths up to the table's last (wider is not narrow)
    attention.<kernel>.<dtype>.<pass>  {"<head_dim>": [[seq_k, FLOP/s], ...], ...}, or by the
                                       heads in one call: {"<head_dim>": {"<heads>": [[seq_k,
                                       FLOP/s], ...], ...}} (heads = batch x query heads; a
                                       kernel fills the GPU with heads x query tiles, so one
                                       head at short lengths runs slower); pass in
                                       fwd, bwd, fwd_causal, bwd_causal (causal rates count
                                       the causal FLOPs, half the dense ones, as the
                                       FlashAttention papers do); kernel in sdpa, flash-attn,
                                       fa3, cudnn, math
    attention_gqa.<kernel>.<dtype>.<pass> (optional)
                                       {"<head_dim>": {"<group>": {"<heads>": [[seq_k, FLOP/s],
                                       ...]}}}: the rates of a call whose K/V heads each serve
                                       ``group`` query heads (grouped-query attention passed
                                       to a kernel that shares K/V natively: fewer K/V tiles
                                       to load per query tile); ``attention`` holds group 1
    memory_bandwidth                   bytes/s that memory-bound kernels reach (read + write)
    launch_overhead_s                  seconds a kernel occupies its stream at the least
    host_op_s (optional)               seconds the host needs to issue one eager op (Python,
                                       dispatcher, autograd): a window of many small kernels
                                       takes at least its ops x this (the GPU waits on the host)
    collectives.<scope>.<op>           {"bus_bandwidth": bytes/s, "latency_s": s}; scope intra
                                       (ranks in one node) or inter (across nodes); op in
                                       all_to_all, all_gather, reduce_scatter, all_reduce, p2p;
                                       bus bandwidth as nccl-tests defines it (PERFORMANCE.md);
                                       inter all_to_all: the rate of one GPU's bytes for other
                                       nodes (one NIC's: an all-to-all cannot aggregate NICs),
                                       its bytes for its own node priced by intra all_to_all
    host_copy.<direction>_<memory>     bytes/s; direction h2d or d2h, memory pinned or pageable
                                       (pageable d2h: into pages the copy maps, as a new host
                                       tensor's are)
    host_copy.d2h_pageable_warm        bytes/s (optional): d2h into pageable host pages
                                       already written (a zeroed accumulator); without it
                                       such a copy is priced at d2h_pageable, the slower

Tables are interpolated linearly in log2(x) and held flat beyond their ends; tables by heads are
interpolated in log2(heads) between the two nearest, held flat beyond the ends; rates by GQA group
are interpolated in log2(group) between group 1 (``attention``) and the measured groups, held
flat beyond the largest (a kernel without ``attention_gqa`` rates runs every group at group 1's).
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

PROFILE_DIR = Path(__file__).parent / "profiles"
DEFAULT_PROFILE = "h100-sxm"  # the paper's GPU (arXiv 2602.21196, §5: 8x H100 80 GB per node)
COLLECTIVE_OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "p2p")
SCOPES = ("intra", "inter")
PASSES = ("fwd", "bwd", "fwd_causal", "bwd_causal")
HOST_COPIES = ("h2d_pinned", "d2h_pinned", "h2d_pageable", "d2h_pageable")
WARM_COPY = "d2h_pageable_warm"  # optional (``Profile.host_copy``)
REQUIRED = ("device", "gpu_mem_gib", "side_streams", "peak_flops", "matmul", "attention",
            "memory_bandwidth", "launch_overhead_s", "collectives", "host_copy")


def attention_flops(b: int, h: int, s_q: int, s_k: int, d: int, pass_: str) -> float:
    """FLOPs of one attention call in the convention the profiles' attention rates use: the
    FlashAttention papers' (arXiv 2205.14135 §4, 2407.08608 §4.1): forward 4 * B * H * S_q * S_k
    * D (two matmuls), backward 2.5x the forward (torch.utils.flop_counter's SDPA formulas count
    the same), a causal pass half of that (``pass_`` in PASSES)."""
    fwd = 4.0 * b * h * s_q * s_k * d
    total = fwd * (2.5 if pass_.startswith("bwd") else 1.0)
    return total / 2 if pass_.endswith("_causal") else total


class ProfileError(ValueError):
    """A profile that cannot be used: unknown name, unreadable file, or a field that breaks a
    rule (the message names the field)."""


def _strip(tree, path: str):
    """The tree with every constant replaced by its value; raises on a number outside a
    constant or a constant without a source."""
    if isinstance(tree, dict) and "value" in tree:
        source = tree.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ProfileError(f"{path}: a constant needs a non-empty 'source' (where the value "
                               "comes from)")
        return tree["value"]
    if isinstance(tree, dict):
        return {k: _strip(v, f"{path}.{k}" if path else k) for k, v in tree.items()}
    # a bool is a constant too (side_streams flips the overlap model); strings (names,
    # descriptions, provenance) are not
    if isinstance(tree, (int, float, list)):
        what = "a flag" if isinstance(tree, bool) else "a number"
        raise ProfileError(f"{path}: {tree!r} is {what} without a source; write it as "
                           '{"value": ..., "source": "..."}')
    return tree


def _table(points, field: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    try:
        pts = sorted((float(x), float(y)) for x, y in points)
    except (TypeError, ValueError):
        raise ProfileError(f"{field}: must be a list of [x, value] pairs") from None
    # NaN compares false with everything, so "not > 0" (and finiteness) is what refuses it
    if not pts or not all(0 < x < math.inf and 0 < y < math.inf for x, y in pts):
        raise ProfileError(f"{field}: must be a non-empty list of positive, finite [x, value] "
                           "pairs")
    return tuple(x for x, _ in pts), tuple(y for _, y in pts)


def _interp(table: tuple[tuple[float, ...], tuple[float, ...]], x: float) -> float:
    xs, ys = table
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    t = (math.log2(x) - math.log2(xs[i - 1])) / (math.log2(xs[i]) - math.log2(xs[i - 1]))
    return ys[i - 1] + t * (ys[i] - ys[i - 1])


def _positive(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0 < value < math.inf):
        raise ProfileError(f"{field}: must be a positive, finite number, got {value!r}")
    return float(value)


def _capability(value) -> tuple[int, int]:
    """(major, minor) of a ``compute_capability`` value, a string "<major>.<minor>"."""
    m = re.fullmatch(r"([0-9]+)\.([0-9]+)", value) if isinstance(value, str) else None
    if m is None:
        raise ProfileError('compute_capability: must be a string "<major>.<minor>" (e.g. '
                           f'"9.0"), got {value!r}')
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True, eq=False)  # identity hash: cached lookups per loaded profile
class Profile:
    """One hardware profile, validated; rates are looked up by the methods below."""

    name: str
    path: str
    values: dict  # the JSON with every constant replaced by its value

    # --- lookups ----------------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self.values["device"]

    @property
    def side_streams(self) -> bool:
        return bool(self.values["side_streams"])

    @property
    def gpu_mem_gib(self) -> float:
        return float(self.values["gpu_mem_gib"])

    @property
    def memory_bandwidth(self) -> float:
        return float(self.values["memory_bandwidth"])

    @property
    def launch_overhead_s(self) -> float:
        return float(self.values["launch_overhead_s"])

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The GPU's CUDA compute capability (major, minor), None when the profile has none."""
        cc = self.values.get("compute_capability")
        return None if cc is None else _capability(cc)

    @property
    def host_op_s(self) -> float:
        """Host seconds per eager op; 0 when the profile has none (the host never binds)."""
        return float(self.values.get("host_op_s", 0.0))

    def peak_flops(self, dtype: str) -> float | None:
        """The dense matmul peak for ``dtype``, None if the profile has none."""
        v = self.values["peak_flops"].get(dtype)
        return None if v is None else float(v)

    def mfu_peak(self, dtype: str) -> float | None:
        """MFU's denominator for ``dtype``: the peak, if no rate the profile prices in ``dtype``
        (matmul, attention of any kernel) exceeds it; else None, and no MFU. A fraction of a
        peak that some kernel beats is no utilisation: fp32 matmuls run on the CUDA cores (the
        suite leaves TF32 off), while fp32 attention runs 3xTF32 tensor-core MMAs, 41.8 TFLOP/s
        against the A100's 19.5 (the shipped profiles' sources), so an fp32 step's MFU could
        exceed 1."""
        peak = self.peak_flops(dtype)
        if peak is None:
            return None
        # every table's key ends in its dtype: (matmul|matmul_narrow, dtype), (attention*, kernel,
        # dtype)
        fastest = max((r for key, t in self._tables.items() if key[-1] == dtype
                       for r in _rates(t)), default=0.0)
        return None if fastest > peak else peak

    def matmul_rate(self, dtype: str, m: int, n: int, k: int) -> float:
        """FLOP/s of an (m x k) @ (k x n) product in ``dtype``: the rate of the square product
        of the same work, (m n k)^(1/3) on a side (a long-and-thin product of many tokens runs
        at a large square one's rate; a small one is launch-bound as a small square one is),
        capped by ``matmul_narrow`` where the output's narrow side or the inner dimension is
        narrow (a stage's few heads: the tiles along it cannot fill the tensor cores)."""
        rate = _interp(self._matmul(dtype), (m * n * k) ** (1 / 3))
        narrow = self._tables.get(("matmul_narrow", dtype), {})
        for side, width in (("out", min(m, n)), ("inner", k)):
            table = narrow.get(side)
            if table is not None and width <= table[0][-1]:
                rate = min(rate, _interp(table, width))
        return rate

    def attention_rate(self, kernel: str, dtype: str, pass_: str, head_dim: int,
                       seq_k: int, heads: int | None = None, group: int = 1) -> float:
        """FLOP/s of an attention call (``pass_`` in PASSES) of ``heads`` (batch x query heads;
        None: the most a table has) whose K/V heads each serve ``group`` query heads, counted
        as the rate's pass counts them; a causal pass without its own table takes the
        non-causal one's rate."""
        rate = _rate_by_heads(_pass_table(self._attention(kernel, dtype), pass_, head_dim),
                              seq_k, heads)
        gqa = self._tables.get(("attention_gqa", kernel, dtype))
        if group <= 1 or gqa is None:
            return rate
        by_group = _pass_table(gqa, pass_, head_dim)
        if by_group is None:
            return rate
        # group 1 is the plain table: interpolate in log2(group) between the two nearest
        points = [(1, rate)] + [(g, _rate_by_heads(t, seq_k, heads))
                                for g, t in sorted(by_group.items())]
        g = min(group, points[-1][0])
        i = next(i for i, (x, _) in enumerate(points) if x >= g)
        if points[i][0] == g:
            return points[i][1]
        (g0, r0), (g1, r1) = points[i - 1], points[i]
        return r0 + (math.log2(g) - math.log2(g0)) / (math.log2(g1) - math.log2(g0)) * (r1 - r0)

    def collective(self, op: str, scope: str) -> tuple[float, float]:
        """(bus bandwidth bytes/s, latency s) of ``op`` within ``scope`` (intra / inter)."""
        c = self.values["collectives"][scope][op]
        return float(c["bus_bandwidth"]), float(c["latency_s"])

    def host_copy(self, direction: str, pinned: bool, warm: bool = False) -> float:
        """Bytes/s of a host<->device copy (``direction`` h2d or d2h); ``warm``: into pageable
        host pages already written (``d2h_pageable_warm`` where the profile has it)."""
        copies = self.values["host_copy"]
        if warm and not pinned and direction == "d2h" and WARM_COPY in copies:
            return float(copies[WARM_COPY])
        return float(copies[f"{direction}_{'pinned' if pinned else 'pageable'}"])

    # --- validation -------------------------------------------------------------------------

    def _matmul(self, dtype: str):
        tables = self._tables
        if ("matmul", dtype) not in tables:
            raise ProfileError(f"profile {self.name!r}: matmul has no {dtype!r} rates (has "
                               f"{sorted(self.values['matmul'])})")
        return tables[("matmul", dtype)]

    def _attention(self, kernel: str, dtype: str) -> dict:
        att = self._tables.get(("attention", kernel, dtype))
        if att is None:
            have = {k: sorted(v) for k, v in self.values["attention"].items()}
            raise ProfileError(f"profile {self.name!r}: attention has no rates for kernel "
                               f"{kernel!r} in {dtype!r} (has {have})")
        return att

    @property
    def _tables(self) -> dict:
        return _parsed_tables(self)

    def validate(self) -> None:
        """Raise ProfileError naming the first field that breaks a rule."""
        v = self.values
        missing = [f for f in REQUIRED if f not in v]
        if missing:
            raise ProfileError(f"profile {self.name!r} ({self.path}) lacks {', '.join(missing)}")
        if v["device"] not in ("cuda", "cpu"):
            raise ProfileError(f"device: must be 'cuda' or 'cpu', got {v['device']!r}")
        if not isinstance(v["side_streams"], bool):
            raise ProfileError(f"side_streams: must be true or false, got {v['side_streams']!r}")
        for f in ("gpu_mem_gib", "memory_bandwidth", "launch_overhead_s"):
            _positive(v[f], f)
        if "host_op_s" in v:
            _positive(v["host_op_s"], "host_op_s")
        if "compute_capability" in v:
            _capability(v["compute_capability"])
        for dtype, peak in v["peak_flops"].items():
            _positive(peak, f"peak_flops.{dtype}")
        for scope in SCOPES:
            for op in COLLECTIVE_OPS:
                field = f"collectives.{scope}.{op}"
                c = v["collectives"].get(scope, {}).get(op)
                if not isinstance(c, dict):
                    raise ProfileError(f"{field}: missing (bus_bandwidth and latency_s)")
                _positive(c.get("bus_bandwidth"), f"{field}.bus_bandwidth")
                lat = c.get("latency_s")
                if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not (
                        0 <= lat < math.inf):
                    raise ProfileError(f"{field}.latency_s: must be a finite number >= 0, got "
                                       f"{lat!r}")
        for name in HOST_COPIES:
            _positive(v["host_copy"].get(name), f"host_copy.{name}")
        if WARM_COPY in v["host_copy"]:
            _positive(v["host_copy"][WARM_COPY], f"host_copy.{WARM_COPY}")
        _parsed_tables(self)  # the tables' own rules


@cache
def _parsed_tables(profile: Profile) -> dict:
    out = {}
    for dtype, pts in profile.values["matmul"].items():
        out[("matmul", dtype)] = _table(pts, f"matmul.{dtype}")
    narrow_tables = profile.values.get("matmul_narrow", {})
    if not isinstance(narrow_tables, dict):
        raise ProfileError("matmul_narrow: must map dtypes to {'out': [[width, FLOP/s], ...], "
                           "'inner': [...]}")
    for dtype, sides in narrow_tables.items():
        field = f"matmul_narrow.{dtype}"
        if not isinstance(sides, dict) or not sides or set(sides) - {"out", "inner"}:
            raise ProfileError(f"{field}: must map 'out' and/or 'inner' to [[width, FLOP/s], "
                               "...]")
        out[("matmul_narrow", dtype)] = {side: _table(t, f"{field}.{side}")
                                         for side, t in sides.items()}
    attention = _attention_tree(profile.values, "attention", _by_dim)
    for (_, kernel, dtype), parsed in attention.items():
        for need in ("fwd", "bwd"):
            if need not in parsed:
                raise ProfileError(f"attention.{kernel}.{dtype}: lacks the {need!r} pass")
    return out | attention | _attention_tree(profile.values, "attention_gqa", _by_dim_and_group)


def _rates(parsed) -> list[float]:
    """Every rate of a parsed table: an (xs, rates) pair, or dicts of them at any depth."""
    if isinstance(parsed, dict):
        return [r for t in parsed.values() for r in _rates(t)]
    return list(parsed[1])


def _attention_tree(values: dict, name: str, parse) -> dict:
    """A profile's tree ``name`` (kernel -> dtype -> pass -> by head dim) as {(name, kernel,
    dtype): {pass: parse(by_dim, field)}}, every pass one of ``PASSES``; {} without one."""
    out = {}
    for kernel, by_dtype in values.get(name, {}).items():
        for dtype, by_pass in by_dtype.items():
            parsed = {}
            for pass_, by_dim in by_pass.items():
                field = f"{name}.{kernel}.{dtype}.{pass_}"
                if pass_ not in PASSES:
                    raise ProfileError(f"{field}: pass must be one of {list(PASSES)}")
                try:
                    parsed[pass_] = parse(by_dim, field)
                except ValueError as e:
                    if isinstance(e, ProfileError):
                        raise
                    keys = "head dims, groups and head counts" if name == "attention_gqa" \
                        else "head dims and head counts"
                    raise ProfileError(f"{field}: {keys} must be integers") from None
            out[(name, kernel, dtype)] = parsed
    return out


def _by_dim(by_dim, field: str) -> dict:
    """``attention``'s pass: {head dim: table, or tables by heads}."""
    if not isinstance(by_dim, dict) or not by_dim:
        raise ProfileError(f"{field}: must map head dims to [[seq_k, FLOP/s], ...]")
    return {int(d): _by_heads(t, f"{field}.{d}") for d, t in by_dim.items()}


def _by_dim_and_group(by_dim, field: str) -> dict:
    """``attention_gqa``'s pass: {head dim: {group >= 2: table, or tables by heads}}."""
    if not isinstance(by_dim, dict) or not by_dim or not all(
            isinstance(t, dict) and t for t in by_dim.values()):
        raise ProfileError(f"{field}: must map head dims to {{group: {{heads: [[seq_k, "
                           "FLOP/s], ...]}}}")
    parsed = {int(d): {int(g): _by_heads(t, f"{field}.{d}.{g}") for g, t in by_group.items()}
              for d, by_group in by_dim.items()}
    if min(min(g) for g in parsed.values()) < 2:
        raise ProfileError(f"{field}: groups must be at least 2 (group 1 is the plain table, "
                           f"{field.replace('attention_gqa', 'attention', 1)})")
    return parsed


def _pass_table(by_pass: dict, pass_: str, head_dim: int):
    """The table of ``pass_`` (the non-causal one's when the causal pass has none; None when
    neither is there) at the nearest measured head dim (log distance: rates grow with it)."""
    if pass_ not in by_pass:
        pass_ = pass_.removesuffix("_causal")
    by_dim = by_pass.get(pass_)
    if by_dim is None:
        return None
    return by_dim[min(by_dim, key=lambda d: abs(math.log2(d) - math.log2(head_dim)))]


def _rate_by_heads(table, seq_k: int, heads: int | None) -> float:
    """A table's rate at ``seq_k``; by heads: interpolated in log2(heads) between the two
    nearest counts, held flat beyond the ends (None: the most heads)."""
    if not isinstance(table, dict):  # one table for every head count
        return _interp(table, seq_k)
    counts = sorted(table)
    h = counts[-1] if heads is None else min(max(heads, counts[0]), counts[-1])
    i = bisect.bisect_left(counts, h)
    if counts[i] == h:
        return _interp(table[h], seq_k)
    lo, hi = counts[i - 1], counts[i]
    t = (math.log2(h) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    r_lo, r_hi = _interp(table[lo], seq_k), _interp(table[hi], seq_k)
    return r_lo + t * (r_hi - r_lo)


def _by_heads(table, field: str):
    """One attention table (``[[seq_k, FLOP/s], ...]``) or a table per head count."""
    if isinstance(table, dict):
        if not table:
            raise ProfileError(f"{field}: must map head counts to [[seq_k, FLOP/s], ...]")
        heads = {int(h): _table(t, f"{field}.{h}") for h, t in table.items()}
        if min(heads) < 1:
            raise ProfileError(f"{field}: head counts must be positive")
        return heads
    return _table(table, field)


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with the suite."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@cache
def load_profile(name_or_path: str) -> Profile:
    """The profile named ``name_or_path`` (a shipped profile's name) or at that path (a
    ``.json`` file, e.g. from ``upipe-bench calibrate``), validated."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ProfileError(f"hardware profile file {name_or_path!r} does not exist")
    else:
        path = PROFILE_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise ProfileError(f"hardware profile must be one of {shipped_profiles()} or a path "
                               f"to a profile .json, got {name_or_path!r}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"hardware profile {str(path)!r} is not readable JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ProfileError(f"hardware profile {str(path)!r}: must be a JSON object")
    name = raw.get("name") or path.stem
    values = {k: v for k, v in raw.items() if k not in ("name", "description")}
    cc = values.get("compute_capability")
    if cc is not None and not (isinstance(cc, dict) and "value" in cc):  # a string passes _strip
        raise ProfileError('compute_capability: write it as a constant {"value": '
                           '"<major>.<minor>", "source": "..."}')
    profile = Profile(name=name, path=str(path), values=_strip(values, ""))
    profile.validate()
    return profile


def profile_for(hw) -> Profile | None:
    """The time model's profile for the emulated ``Hardware``: its ``profile``, by default
    ``h100-sxm`` on an emulated cuda device and none on cpu (no emulated time). Raises
    ProfileError when the profile is for another device than the one emulated."""
    name = hw.profile or (DEFAULT_PROFILE if hw.device == "cuda" else None)
    if name is None:
        return None
    profile = load_profile(name)
    if profile.device != hw.device:
        raise ProfileError(f"hardware profile {profile.name!r} is for a {profile.device} "
                           f"device, but the emulated device is {hw.device!r}")
    return profile
