"""What the analysis notebooks share (notebooks/; docs/conventions.md#notebooks-read-results-only):
find ``results/``, read its tables and provenance, label and order variants, list what did not run,
and build the tables the notebooks show.

A notebook stays a sequence of ``display(nb.something(...))`` cells with markdown between them::

    from experiments.reporting import notebook as nb
    RESULTS = nb.find_results()
    SWEEPS = nb.sweep_dirs(RESULTS, "table3_llama3_8b_h100x8")   # scale -> results/<sweep>/
    rows, maxctx = nb.load_tables(SWEEPS)

Reads result files only (``sweep.json``, ``env.json``, ``rows.csv``, ``max_context.csv``, the
baseline's ``max_context.json``; ``runs/`` and ``searches/`` only counted, to refuse a table cut
short) and writes nothing; figures are the sweeps' own plot functions
(``experiments.reporting.plots``) drawn into a temporary file and returned as PNG bytes.
Lengths are global tokens in binary units (128K = 131072), as the sweeps declare them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from experiments import store
from experiments.config.sizes import MiB
from experiments.config.status import Status
from experiments.reporting import paper_grid, plot_common, plot_labels, plots, results_index
from experiments.reporting.plot_labels import memory_unit  # noqa: F401  (the notebooks' too)
from experiments.reporting.tables import (
    MAXCTX,
    MAXCTX_COLUMNS,
    ROW_COLUMNS,
    ROWS,
    check_table,
)

SCALES = {"paper": "", "cpu": "-cpu", "emulated": "-emulated"}  # scale -> sweep-name suffix
VARIANT_COLUMNS = ["method", "heads_per_stage", "ring_degree", "chunk_size", "nproc", "doc_len",
                   "overlap"]
# columns of rows.csv the notebooks read beyond ROW_COLUMNS (absent ones load as NaN)
ROW_EXTRA = ["iters", "workload", "model_n_heads", "attention_peak_bytes"]


# -- files -----------------------------------------------------------------------------------


def find_results(start: Path | None = None) -> Path:
    """The repository's ``results/`` folder, from ``start`` (default: the working directory,
    the repository root or ``notebooks/``) or a folder above it."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start, *start.parents):
        if (folder / "results" / "README.md").is_file():
            return folder / "results"
    raise FileNotFoundError(f"no results/ folder (with a README.md) in {start} or above it")


def read_csv(path: Path) -> pd.DataFrame:
    """A table as the harness writes it: only empty cells are missing (the stack 'none' and
    the status text stay strings)."""
    return pd.read_csv(path, keep_default_na=False, na_values=[""])


def read_json(path: Path) -> dict:
    """The JSON object in ``path``; ``{}`` when there is no such file, ``store.BadResultFile``
    (naming it) when it is not valid JSON."""
    path = Path(path)
    return store.read_json(path) if path.is_file() else {}


def tokens(n: float | None) -> str:
    """131072 -> '128K', 2**20 -> '1M' (binary units, as the sweeps declare lengths); '' when
    missing."""
    return "" if n is None or pd.isna(n) else plot_labels.format_tokens(n)


# -- sweeps and their provenance -------------------------------------------------------------


def _workload(decl: dict) -> str:
    """What a sweep's cells run: 'step' (a training step, every paper artefact) unless its base
    says otherwise ('attention': one attention layer)."""
    return (decl.get("base") or {}).get("workload", "step")


def sweep_dirs(results: Path, artefact: str | None = None,
               workload: str | None = "step") -> dict[str, Path]:
    """The sweep folders under ``results`` that have run (they hold a ``sweep.json``) and whose
    cells run ``workload`` (None: any). With ``artefact``, its scales keyed by scale, in the
    order of ``SCALES`` (``<artefact>``, ``-cpu``, ``-emulated``); else every sweep, by name."""
    results = Path(results)
    if artefact is None:
        found = {d.name: d for d in sorted(p.parent for p in results.glob("*/sweep.json"))}
    else:
        found = {scale: results / f"{artefact}{suffix}" for scale, suffix in SCALES.items()}
        found = {s: d for s, d in found.items() if (d / "sweep.json").is_file()}
    return {k: d for k, d in found.items()
            if workload is None or _workload(read_json(d / "sweep.json")) == workload}


def not_run(results: Path, artefact: str) -> list[str]:
    """The names of ``artefact``'s sweeps that have no folder with a ``sweep.json`` yet (the
    paper-scale sweep, without a GPU cluster)."""
    return [f"{artefact}{suffix}" for suffix in SCALES.values()
            if not (Path(results) / f"{artefact}{suffix}" / "sweep.json").is_file()]


def _command(env: dict) -> str | None:
    """The command line an ``env.json`` (or ``max_context.json``) records: its ``command``, or
    its ``argv`` (the CLI's as ``upipe-bench ...``, a script's as ``python ...``)."""
    if env.get("command"):
        return env["command"]
    argv = env.get("argv") or []
    if not argv:
        return None
    is_cli = Path(argv[0]).name in ("cli.py", "upipe-bench")
    return " ".join(["upipe-bench", *argv[1:]] if is_cli else ["python", *argv])


def provenance(sweep_dir: Path) -> dict:
    """A sweep's declaration (``sweep.json``) and the process that ran it (``env.json``) in one
    record: scale, description, command, git revisions, date, torch, machine, emulated
    hardware. ``git_rev`` is the rows' revisions with their counts (a sweep resumed at several
    revisions has several; ``results_index.git_revisions``, as ``results/README.md`` prints
    them), env.json's (the last invocation's, marked †) only where the rows carry none."""
    decl, env = read_json(sweep_dir / "sweep.json"), read_json(sweep_dir / "env.json")
    hw = decl.get("hardware")
    return {
        "scale": decl.get("scale"),
        "description": decl.get("description"),
        "command": _command(env),
        "git_rev": results_index.table_revisions(sweep_dir / ROWS, env),
        "date_utc": env.get("date_utc"),
        "torch": env.get("torch_version"),
        "ran on": env.get("gpu_name") or env.get("cpu_model"),
        "emulated hardware": hw and f"{hw['gpus_per_node']}x {hw['gpu_mem_gib']:g} GiB "
                                    f"{hw['device']} per node, " + (
                                        "the measured reserve per method"
                                        if hw.get("reserve_gib") is None
                                        else f"{hw['reserve_gib']:g} GiB reserve"),
    }


def provenance_table(dirs: Mapping[str, Path]) -> pd.DataFrame:
    """``provenance`` of each sweep folder, a column per sweep (named after its folder)."""
    return pd.DataFrame({d.name: provenance(d) for d in dirs.values()})


def _counts(values: pd.Series) -> str:
    """'19 ok, 5 oom': the count of each value, most frequent first."""
    return ", ".join(f"{v} {n}" for v, n in values.value_counts().items())


def inventory(results: Path) -> pd.DataFrame:
    """Every table in ``results`` (each folder's ``rows.csv`` and ``max_context.csv``): the
    scale its sweep declares, its row count, modes and statuses, the git revisions of its rows
    (with their counts; ``provenance``), and the date and command of its folder's ``env.json``
    (``baselines/``: ``max_context.json``)."""
    results = Path(results)
    records = []
    for path in sorted([*results.glob(f"*/{ROWS}"), *results.glob(f"*/{MAXCTX}")]):
        df, folder = read_csv(path), path.parent
        env = read_json(folder / "env.json") or read_json(folder / "max_context.json")
        records.append({
            "table": str(path.relative_to(results)),
            "scale": read_json(folder / "sweep.json").get("scale", ""),
            "rows": len(df),
            # emulate_vs_allocator/ has no mode: each of its rows is both measured and emulated
            "mode": ", ".join(sorted(df["mode"].dropna().unique())) if "mode" in df else "",
            # chunked_backward_gpu/ is a benchmark's table: no status column
            "status": _counts(df["status"]) if "status" in df else "",
            "git_rev": results_index.table_revisions(path, env), "date_utc": env.get("date_utc"),
            "command": _command(env)})
    return pd.DataFrame.from_records(records).set_index("table")


# -- loading and labelling -------------------------------------------------------------------


def relative_variant(method: str, heads_per_stage: float, ring_degree: float,
                     nproc: float, doc_len: float | None = None,
                     overlap: bool | None = None) -> str:
    """A variant's name that reads the same at every scale: U in units of the Ulysses degree
    C = nproc / ring_degree ('upipe U=2C'), hybrids by their ring degree ('usp ring=2'), FPDT
    without its chunk size ('fpdt'), packed documents without their length ('upipe packed'),
    UPipe's overlap when set ('upipe no-overlap')."""
    label = method if ring_degree == 1 else f"{method} ring={ring_degree:g}"
    if pd.notna(heads_per_stage):
        k = heads_per_stage / (nproc / ring_degree)
        label += " U=C" if k == 1 else f" U={k:g}C"
    label += " packed" if pd.notna(doc_len) else ""
    if overlap is not None and pd.notna(overlap):
        label += " overlap" if bool(overlap) else " no-overlap"
    return label


def variant_order(df: pd.DataFrame) -> list[str]:
    """The distinct ``variant`` values of ``df``: Ulysses (the reference) first, then by method,
    U over the Ulysses degree, U, ring degree and chunk size; the default U first."""
    keys = df.assign(_other=df["method"] != "ulysses",
                     _k=df["heads_per_stage"] / (df["nproc"] / df["ring_degree"]))
    keys = keys.sort_values(["_other", "method", "_k", "heads_per_stage", "ring_degree",
                             "chunk_size"], na_position="first", kind="stable")
    return list(dict.fromkeys(keys["variant"]))


def load(dirs: Mapping[str, Path] | Iterable[Path], table: str = ROWS,
         relative: bool = False) -> pd.DataFrame:
    """``table`` (``rows.csv`` or ``max_context.csv``) of each sweep folder in ``dirs`` as one
    frame, with the sweep's ``sweep`` name, ``scale``, ``artefact`` (the name without its scale
    suffix), ``ladder`` (its axes vary the memory stack) and each row's ``variant``: as the
    plots label it ('upipe U=8', 'usp 8x2', 'fpdt c=64K'), or ``relative_variant`` with
    ``relative``. Every column of ``ROW_COLUMNS`` (and ``ROW_EXTRA``) or ``MAXCTX_COLUMNS`` is
    there, NaN where no table has it; a sweep without the table adds no row. A table cut short
    raises ``store.BadResultFile`` naming it (``tables.check_table``)."""
    folders = list(dirs.values()) if isinstance(dirs, Mapping) else list(dirs)
    frames = []
    for folder in folders:
        decl = read_json(folder / "sweep.json")
        if (folder / table).is_file():
            check_table(folder / table)
            frames.append(read_csv(folder / table).assign(
                sweep=decl["name"], scale=decl["scale"], ladder="stack" in decl["axes"],
                artefact=decl["name"].removesuffix(SCALES.get(decl["scale"], ""))))
    columns = [*ROW_COLUMNS, *ROW_EXTRA] if table == ROWS else MAXCTX_COLUMNS
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    df = df.reindex(columns=list(dict.fromkeys([*columns, *df.columns, "scale", "artefact",
                                                "ladder"])))
    if relative:
        options = (df[c] for c in ["method", "heads_per_stage", "ring_degree", "nproc",
                                   "doc_len", "overlap"])
        df["variant"] = [relative_variant(*v) for v in zip(*options, strict=True)]
    else:
        options = (df[c] for c in VARIANT_COLUMNS)
        df["variant"] = [plot_labels.variant_label(*v) for v in zip(*options, strict=True)]
    return df


def load_tables(dirs: Mapping[str, Path] | Iterable[Path], relative: bool = False
                ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(rows, maxctx)``: ``load`` of both tables, their ``variant`` one categorical in
    ``variant_order`` (so every table lists Ulysses first, as the paper does)."""
    folders = list(dirs.values()) if isinstance(dirs, Mapping) else list(dirs)
    rows, maxctx = load(folders, ROWS, relative), load(folders, MAXCTX, relative)
    order = variant_order(pd.concat([rows, maxctx]))
    for df in (rows, maxctx):
        df["variant"] = pd.Categorical(df["variant"], categories=order)
    return rows, maxctx


# -- filtering -------------------------------------------------------------------------------


def status_counts(rows: pd.DataFrame, by: Iterable[str] = ("scale", "mode")) -> pd.DataFrame:
    """Rows per ``by`` group (a row each) and status (a column each)."""
    return rows.groupby([*by, "status"], observed=True).size().unstack(fill_value=0)


def not_ok(rows: pd.DataFrame, columns: Iterable[str] = ("sweep", "variant", "stack",
                                                          "seq_len", "status", "error")
           ) -> pd.DataFrame:
    """Every row whose status is not ``ok`` (oom, skipped, error, timeout, invalid), with
    ``columns`` (the error text last by default), in table order."""
    return rows.loc[rows["status"] != Status.OK, list(columns)]


def not_ok_by_error(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows that are not ``ok`` grouped by sweep, variant, status and error text (sizes
    such as '3.2 GiB' blanked to 'X', so one error at several lengths is one group): how many
    rows and at which lengths."""
    failed = rows[rows["status"] != Status.OK]
    failed = failed.assign(error=failed["error"].str.replace(r"[\d.]+ [GM]iB", "X", regex=True))
    return (failed.groupby(["sweep", "variant", "status", "error"], dropna=False, observed=True)
            ["seq_len"].agg(rows="size", lengths=lambda s: ", ".join(map(tokens, sorted(set(s))))))


# -- tables ----------------------------------------------------------------------------------


# what makes two rows the same cell but for the variant: a ratio's reference runs the same
CELL_KEYS = ["seq_len", "model", "nproc", "stack", "doc_len"]


def vs_ulysses(df: pd.DataFrame, value: str, keys: Iterable[str],
               reference: pd.Series | None = None) -> pd.Series:
    """``value`` of each row over the median of the reference's ``ok`` rows at the same
    ``keys`` (``reference``: a mask of ``df``'s rows, default upipe's Ulysses; a paper table's
    own from ``ratio_reference``); NaN where the reference did not run ok there. Keys as
    ``plot_common.vs_ulysses`` reads them: a NaN ``doc_len`` matches only NaN (a packed row is
    over a packed reference of its document length only), and a method on a stack of its own
    (torch-cp) is over the reference's one stack."""
    ref = plot_common.is_ulysses(df) if reference is None else reference
    ratio = plot_common.vs_ulysses(df, value, list(keys), ref & (df["status"] == Status.OK))
    return pd.Series(ratio, index=df.index)


def ratio_reference(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """The rows a throughput ratio divides by (a mask of ``df``'s rows) and their name: the
    paper table's own Ulysses where ``df`` is a sweep of Table 3 (``usp-ulysses 8x1``) or
    Table 4 (``usp 8x2``) holding it, as the paper divides and the plots draw; else upipe's
    Ulysses (``plot_common.ratio_reference``)."""
    mask, key = plot_common.ratio_reference(df)
    return mask, plot_common.reference_name(key)


def max_context_vs_ulysses(maxctx: pd.DataFrame) -> pd.DataFrame:
    """The ``ok`` searches with ``vs_ulysses`` (over Ulysses' max context of the same artefact
    and scale) and ``text``: '3M (1.25x)', or '3M (-)' where Ulysses has no search there."""
    found = maxctx[maxctx["status"] == Status.OK]
    found = found.assign(vs_ulysses=vs_ulysses(found, "max_seq_len", ["artefact", "scale"]))
    return found.assign(text=[f"{tokens(n)} ({r:.2f}x)" if pd.notna(r) else f"{tokens(n)} (-)"
                              for n, r in zip(found["max_seq_len"], found["vs_ulysses"],
                                              strict=True)])


def by_length(df: pd.DataFrame, value: str, fmt: Callable[[float], str]) -> pd.DataFrame:
    """A row per (variant, stack), a column per length: ``fmt`` of the median ``value`` of a
    cell's ``ok`` rows; '-' when they have no value; else the cell's status in capitals (OOM,
    SKIPPED), as the paper's tables print OOM."""
    def cell(g: pd.DataFrame) -> str:
        values = g.loc[g["status"] == Status.OK, value].dropna()
        if len(values):
            return fmt(values.median())
        return "-" if (g["status"] == Status.OK).any() else g["status"].iloc[0].upper()

    table = (df.groupby(["variant", "stack", "seq_len"], observed=True)[["status", value]]
             .apply(cell).unstack("seq_len").fillna(""))
    return table.rename(columns=tokens)


TIME_PARTS = {"step_time_s": "step", "time_compute_s": "compute",
              "time_comm_exposed_s": "comm exposed", "time_offload_exposed_s": "offload exposed",
              "time_overhead_s": "launch and host overhead"}


def time_breakdown(emulated: pd.DataFrame) -> pd.DataFrame:
    """Where each emulated step goes: a row per (variant, stack, length), the step and its four
    parts in seconds (they sum to the step), and the emulated MFU."""
    cols = [c for c in TIME_PARTS if c in emulated]
    table = (emulated.groupby(["variant", "stack", "seq_len"], observed=True)[cols + ["mfu"]]
             .median().rename(columns=TIME_PARTS).round(3))
    return table.rename(index=tokens, level="seq_len")


VS_PAPER_COLUMNS = ["what", "length", "emulated", "paper", "ratio", "note"]


def vs_paper(results: Path, artefact: str) -> pd.DataFrame:
    """Emulated tokens/s per GPU beside the paper's published value and their ratio, a row per
    cell of the artefact's table in the paper (both outcomes in ``note``), then UPipe over
    Ulysses and over FPDT per length, emulated beside the paper's (``VS_PAPER_COLUMNS``; read
    from ``results/paper_grid/throughput_vs_paper.csv`` and ``upipe_ratios.csv``, written by
    ``python -m experiments.reporting.paper_grid``); empty when they have not been written or
    the artefact is not Table 3 or 4."""
    folder = results / paper_grid.OUT_DIR
    tables = [t for t, sweep in paper_grid.SWEEPS.items() if sweep == f"{artefact}-emulated"]
    cells, ratios = folder / "throughput_vs_paper.csv", folder / "upipe_ratios.csv"
    if not tables or not cells.exists() or not ratios.exists():
        return pd.DataFrame(columns=VS_PAPER_COLUMNS)
    tp, rt = (df[df["table"] == tables[0]] for df in (read_csv(cells), read_csv(ratios)))
    fits = ("paper " + tp["paper_status"] + ", emulated " + tp["emulated_status"]
            + tp["note"].fillna("").map(lambda n: f"; {n}" if n else ""))
    out = [pd.DataFrame({"what": tp["method"] + " " + tp["mesh"] + " tokens/s per GPU",
                         "length": tp["length"], "emulated": tp["emulated_tokens_per_s"],
                         "paper": tp["paper_tokens_per_s"], "ratio": tp["ratio"],
                         "note": fits}),
           pd.DataFrame({"what": rt["ratio"], "length": rt["length"], "emulated": rt["emulated"],
                         "paper": rt["paper"], "ratio": rt["emulated_over_paper"],
                         "note": rt["note"]})]
    return pd.concat(out, ignore_index=True)[VS_PAPER_COLUMNS]


def grid_vs_paper(results: Path, artefact: str) -> pd.DataFrame:
    """The artefact's emulated grid outcomes beside the paper's
    (``results/paper_grid/grid_vs_paper.csv``, ``experiments.reporting.paper_grid``):
    disagreements first, then agreements, then cells without a known paper outcome; empty when
    the table has not been written or the artefact is not Table 3 or 4."""
    path = results / paper_grid.OUT_DIR / "grid_vs_paper.csv"
    tables = [t for t, sweep in paper_grid.SWEEPS.items() if sweep == f"{artefact}-emulated"]
    if not path.exists() or not tables:
        return pd.DataFrame(columns=paper_grid.COLUMNS)
    df = read_csv(path)
    df = df[df["table"] == tables[0]]
    return df.sort_values("agree", key=lambda c: c.map({"no": 0, "yes": 1}).fillna(2),
                          kind="stable").reset_index(drop=True)


def searches(maxctx: pd.DataFrame) -> pd.DataFrame:
    """A row per max-context search: its ``max_context`` (the length, or the status of a search
    that found none), ``first_failing`` length, ``granularity`` and ``vs_ulysses`` (over
    Ulysses' max context at the same scale), with its budget, probe count and error."""
    found = maxctx["status"].eq(Status.OK) & maxctx["max_seq_len"].notna()
    df = maxctx.assign(
        max_context=maxctx["max_seq_len"].map(tokens).where(found, maxctx["status"]),
        first_failing=maxctx["first_failing_seq_len"].map(tokens),
        granularity=maxctx["granularity"].map(tokens),
        vs_ulysses=vs_ulysses(maxctx, "max_seq_len", ["scale"]).round(2))
    return df.sort_values(["scale", "variant"])[
        ["scale", "variant", "stack", "budget_mib", "granularity", "max_context",
         "first_failing", "vs_ulysses", "n_probes", "error"]]


def check_searches(rows: pd.DataFrame, maxctx: pd.DataFrame) -> pd.DataFrame:
    """Each ``ok`` search beside the longest ``ok`` and the shortest ``oom`` row of its scale,
    variant, stack and budget (probes and the sweep's own cells alike); ``agrees`` when they
    are the search's max_seq_len and first_failing_seq_len."""
    keys = ["scale", "variant", "stack", "budget"]
    probes = rows.assign(budget=rows["budget_mib"].fillna(0))
    longest_ok = (probes[probes["status"] == Status.OK]
                  .groupby(keys, observed=True)["seq_len"].max())
    shortest_oom = (probes[probes["status"] == Status.OOM]
                    .groupby(keys, observed=True)["seq_len"].min())
    check = (maxctx[maxctx["status"] == Status.OK].assign(budget=maxctx["budget_mib"].fillna(0))
             .join(longest_ok.rename("longest_ok_row"), on=keys)
             .join(shortest_oom.rename("shortest_oom_row"), on=keys))
    check["agrees"] = ((check["longest_ok_row"] == check["max_seq_len"])
                       & (check["shortest_oom_row"] == check["first_failing_seq_len"]))
    return check[["scale", "variant", "max_seq_len", "longest_ok_row", "first_failing_seq_len",
                  "shortest_oom_row", "agrees"]]


LADDER_PARTS = {"peak_device_bytes": "device peak", "peak_model_bytes": "model states",
                "peak_attention_bytes": "attention", "peak_other_bytes": "other",
                "peak_host_bytes": "host (offloaded)"}


def ladder(df: pd.DataFrame) -> pd.DataFrame:
    """A row per (variant, stack) of one sweep: the first status, the median of each memory
    part (``LADDER_PARTS``, bytes), ``vs none`` (device peak over the same variant's without a
    stack) and ``vs ulysses`` (over Ulysses' at the same stack)."""
    table = df.groupby(["variant", "stack"], observed=True).agg(
        status=("status", "first"),
        **{name: (col, "median") for col, name in LADDER_PARTS.items()}).reset_index()
    peak = table[["variant", "stack", "device peak"]]
    none = peak[peak["stack"] == "none"].drop(columns="stack")
    ulysses = peak[peak["variant"] == "ulysses"].drop(columns="variant")
    table = (table.merge(none, on="variant", how="left", suffixes=("", " of none"))
             .merge(ulysses, on="stack", how="left", suffixes=("", " of ulysses")))
    table["vs none"] = table["device peak"] / table["device peak of none"]
    table["vs ulysses"] = table["device peak"] / table["device peak of ulysses"]
    return (table.drop(columns=["device peak of none", "device peak of ulysses"])
            .set_index(["variant", "stack"]))


def vs_no_stack(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of the sweeps whose axes vary the stack (``ladder``) with ``vs_none``: the device
    peak over the median of the same sweep's variant without a stack (``none``) at the same
    length, model and ranks. Only the variants with such a ``none`` row: a sweep of other
    stacks only (selective recomputation) has nothing to anchor the ratio, and no panel."""
    keys = ["sweep", "variant", "seq_len", "model", "nproc"]
    ladder = rows[rows["ladder"] & rows["peak_device_bytes"].notna()]
    none = (ladder[ladder["stack"] == "none"].groupby(keys, observed=True)["peak_device_bytes"]
            .median().rename("_none"))
    ladder = ladder.join(none, on=keys)
    ladder = ladder.assign(vs_none=ladder["peak_device_bytes"] / ladder["_none"])
    return ladder[ladder["vs_none"].notna()].drop(columns="_none")


def per_u(df: pd.DataFrame) -> pd.DataFrame:
    """A row per variant of one sweep's ``ok`` rows (medians): ``U/C`` (heads per stage over
    the Ulysses degree C = nproc / ring degree), ``stages`` (H / U), peak memory, attention
    memory (its share at the peak and its own peak), tokens/s per GPU, and the peak's and the
    tokens/s' ratios to Ulysses (which must be among the rows)."""
    degree = df["nproc"] / df["ring_degree"]
    df = df.assign(u_over_c=df["heads_per_stage"] / degree,
                   stages=df["model_n_heads"] / df["heads_per_stage"].fillna(df["model_n_heads"]))
    table = df.groupby("variant", observed=True).agg(
        u_over_c=("u_over_c", "median"), stages=("stages", "median"),
        peak=("peak_device_bytes", "median"), attention=("peak_attention_bytes", "median"),
        attention_own_peak=("attention_peak_bytes", "median"),
        tokens_per_s_per_gpu=("tokens_per_s_per_gpu", "median"))
    for col in ("peak", "tokens_per_s_per_gpu"):
        table[f"{col} vs ulysses"] = table[col] / table.loc["ulysses", col]
    return table.rename(columns={"u_over_c": "U/C"})


def baseline_vs_sweeps(baseline: pd.DataFrame, maxctx: pd.DataFrame) -> pd.DataFrame:
    """The CI baseline's searches (``results/baselines/max_context.csv``) beside the sweeps' ``ok``
    searches of the same cell: mode, method, model, ranks, ring degree, stack, dtype and budget,
    and the guard's defaults for what its table has no column for (the method's own heads per
    stage, no overlap, no documents, no full RoPE table: the paper-table sweeps hold one, so
    their searches are of other cells). ``agrees`` when the two max contexts are equal (empty
    where no sweep searched that cell)."""
    keys = ["mode", "method", "model", "nproc", "ring_degree", "stack", "dtype", "budget_mib"]
    unset = pd.Series(True, index=maxctx.index)
    for col in ("heads_per_stage", "doc_len", "overlap", "global_rope_table"):
        if col in maxctx:  # missing, or false for the flags
            unset &= maxctx[col].isna() | maxctx[col].isin([False, "False"])
    ok = maxctx[(maxctx["status"] == Status.OK) & unset]
    # no budget (the GPU's memory less the reserve) is a setting too: -1 stands for it
    sweeps = (ok.assign(budget_mib=ok["budget_mib"].fillna(-1)).groupby(keys)["max_seq_len"]
              .max().rename("sweep_max_seq_len"))
    df = (baseline.assign(budget_mib=baseline["budget_mib"].fillna(-1)).join(sweeps, on=keys)
          .assign(budget_mib=baseline["budget_mib"]))
    return df.assign(
        max_context=df["max_seq_len"].map(tokens).where(df["status"] == Status.OK,
                                                        df["status"]),
        first_failing=df["first_failing_seq_len"].map(tokens),
        sweep_max_context=df["sweep_max_seq_len"].map(tokens),
        agrees=(df["sweep_max_seq_len"] == df["max_seq_len"]).where(
            df["sweep_max_seq_len"].notna()),
    )[["name", "mode", "max_context", "first_failing", "sweep_max_context", "agrees", "error"]]


def attention_layer_table(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of the attention-layer workload (``bench_attention``, ``upipe_overlap-cpu``) as
    (sweep, nproc, variant) x length, lengths in numeric order: the median tokens/s per GPU and
    attention MiB (``peak_attention_bytes``) of the ``ok`` rows. The sweep and its rank count
    stay in the index: sweeps of different ranks are not one comparison."""
    ok = rows[rows["status"] == Status.OK]
    table = (ok.assign(nproc=ok["nproc"].astype(int),
                       attention_mib=ok["peak_attention_bytes"] / MiB)
             .pivot_table(index=["sweep", "nproc", "variant"], columns="seq_len", observed=True,
                          aggfunc="median", values=["tokens_per_s_per_gpu", "attention_mib"])
             .round(1))
    return table.rename(columns=tokens, level="seq_len")


# -- figures ---------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class Png:
    """A PNG image; Jupyter shows it inline (``_repr_png_``), ``data`` holds its bytes."""

    data: bytes

    def _repr_png_(self) -> bytes:
        return self.data

    def __repr__(self) -> str:  # the text a front end without images shows
        return f"<PNG image, {len(self.data) / 1024:.0f} KiB>"


def figure(plot: str, rows: pd.DataFrame, maxctx: pd.DataFrame) -> Png | None:
    """The sweeps' figure ``plot`` (a name in ``plots.PLOTS``) drawn from these tables, as a
    sweep draws its PNG: into a temporary file, nothing kept; None when the tables lack its
    data (no ok rows, no search)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{plot}.png"
        return Png(path.read_bytes()) if plots.PLOTS[plot](rows, maxctx, path) else None


def figures(dirs: Mapping[str, Path], rows: pd.DataFrame, maxctx: pd.DataFrame
            ) -> list[tuple[str, Png | None]]:
    """``('<sweep>: <plot>', figure)`` for each plot each sweep declares (``plots`` in its
    ``sweep.json``), drawn from that sweep's rows only (figure None: nothing to draw)."""
    out = []
    for folder in dirs.values():
        decl = read_json(folder / "sweep.json")
        mine = rows[rows["sweep"] == decl["name"]], maxctx[maxctx["sweep"] == decl["name"]]
        out += [(f"{decl['name']}: {name}", figure(name, *mine)) for name in decl["plots"]]
    return out
