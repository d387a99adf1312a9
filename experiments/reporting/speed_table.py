"""docs/results.md's "UPipe at Ulysses speed" table, rendered from the committed rows.

One row per length, one column per UPipe variant (mesh, overlapped stages) of each emulated
paper table (Table 3: Llama3-8B on 8 GPUs; Table 4: Qwen3-32B on 16), each cell the variant's
emulated tokens/s per GPU over the Ulysses of its own mesh at the same length, stack and kernel
(``plot_common.vs_ulysses``): on P x 1, upipe's ``ulysses``; on a hybrid mesh (8 x 2), the USP
hybrid of that ring degree, the paper's Table 4 reference, so that the column reads beside the
paper's ratio (``results/paper_grid/upipe_ratios.csv``). Each column names its denominator. A ratio
whose UPipe or reference cell does not fit the device is marked: the emulated step still has a
time, but no run would. Rendered from ``rows.csv``, never typed; written between two markers in
docs/results.md, which ``./run_all.sh`` rewrites after the results index.

    python -m experiments.reporting.speed_table          # rewrite the section
    python -m experiments.reporting.speed_table --check  # exit 1 when it is stale (a test)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from experiments.reporting.plot_common import vs_ulysses
from experiments.reporting.plot_labels import format_tokens, variant_label
from experiments.reporting.sections import GeneratedSection

BEGIN, END = "<!-- upipe-speed-table:begin -->", "<!-- upipe-speed-table:end -->"
COMMAND = "python -m experiments.reporting.speed_table"
ROOT = Path(__file__).resolve().parents[2]
# the emulated paper tables, in the order of their columns
SWEEPS = ("table3_llama3_8b_h100x8-emulated", "table4_qwen3_32b_h100x16-emulated")
MODEL_NAMES = {"llama3-8b": "Llama3-8B", "qwen3-32b": "Qwen3-32B"}
NOT_FIT = "†"  # marks a ratio whose UPipe or Ulysses cell is over a budget


def _timed(rows: pd.DataFrame) -> pd.DataFrame:
    """The timed Ulysses, USP and UPipe rows (not a search's probes), one per cell, with
    ``ring``: the ring degree, 1 where unset."""
    df = rows[(rows["iters"] > 0) & rows["method"].isin(["ulysses", "usp", "upipe"])
              & rows["heads_per_stage"].isna() & rows["tokens_per_s_per_gpu"].notna()]
    df = df.drop_duplicates("cell_id").reset_index(drop=True)
    return df.assign(ring=df["ring_degree"].fillna(1).astype(int))


def _overlapped(v) -> int:
    """1 for a row whose ``overlap`` is set (True, or "True" read back from a CSV), else 0."""
    return int(v is True or v == "True" or v == 1)


def _reference(ring: int, nproc: int) -> str:
    """The Ulysses of a mesh, a ratio's denominator: 'ulysses' on P x 1, 'usp 8x2' on 8 x 2."""
    return "ulysses" if ring == 1 else variant_label("usp", ring_degree=ring, nproc=nproc)


def _column_name(r: pd.Series) -> str:
    """'Llama3-8B, 8 GPUs: upipe / ulysses' (the mesh only where it is not P x 1)."""
    ring = r["ring"] if r["ring"] > 1 else None
    overlap = True if _overlapped(r["overlap"]) else None
    label = variant_label("upipe", ring_degree=ring, nproc=r["nproc"], overlap=overlap)
    return (f"{MODEL_NAMES.get(r['model'], r['model'])}, {int(r['nproc'])} GPUs: "
            f"{label} / {_reference(r['ring'], r['nproc'])}")


def ratios(rows: pd.DataFrame) -> pd.DataFrame:
    """One emulated sweep's UPipe variants over the Ulysses of their mesh (``_reference``): a
    row per (column, seq_len) with the ratio and whether both cells fit (``fits``). rows: a
    sweep's rows.csv."""
    df = _timed(rows)
    reference = ((df["method"] == "ulysses") & (df["ring"] == 1)) | (df["method"] == "usp")
    df = df.assign(ratio=vs_ulysses(df, "tokens_per_s_per_gpu",
                                    ["seq_len", "model", "nproc", "stack", "kernel", "ring"],
                                    reference))
    ref_ok = df[reference].set_index(["ring", "seq_len"])["status"].eq("ok")
    up = df[(df["method"] == "upipe") & df["ratio"].notna()]
    # columns in a fixed order: the P x 1 mesh first, blocking stages before overlapped ones
    order = up["ring"] * 2 + up["overlap"].map(_overlapped)
    up = up.assign(_order=order).sort_values(["_order", "seq_len"], kind="stable")
    both_ok = [ref_ok.get((ring, n), False) for ring, n in zip(up["ring"], up["seq_len"],
                                                               strict=True)]
    return pd.DataFrame({
        "column": [_column_name(r) for _, r in up.iterrows()],
        "seq_len": up["seq_len"].astype(int).to_numpy(),
        "ratio": up["ratio"].to_numpy(),
        "fits": up["status"].eq("ok").to_numpy() & np.array(both_ok, dtype=bool),
    })


def table(frames: list[pd.DataFrame]) -> list[str]:
    """The markdown table of ``ratios`` frames side by side: a row per length."""
    df = pd.concat(frames, ignore_index=True)
    columns = list(dict.fromkeys(df["column"]))
    cells = {(r.column, r.seq_len): f"{r.ratio:.4f}" + ("" if r.fits else f" {NOT_FIT}")
             for r in df.itertuples()}
    lines = ["| length | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for s in sorted(df["seq_len"].unique()):
        lines.append(f"| {format_tokens(s)} | "
                     + " | ".join(cells.get((c, s), "—") for c in columns) + " |")
    return lines


def render(results: Path) -> str:
    """The generated section, markers included (without rows: a line saying so)."""
    frames = [ratios(pd.read_csv(results / name / "rows.csv")) for name in SWEEPS
              if (results / name / "rows.csv").exists()]
    frames = [f for f in frames if len(f)]
    body = (table(frames) + ["", f"{NOT_FIT}: UPipe's or its reference's cell does not fit the "
                             "device at that length; the ratio is of the emulated steps all the "
                             "same."]
            if frames else ["No emulated Table 3 or Table 4 rows with Ulysses and UPipe."])
    return SECTION.text([*body, ""])


SECTION = GeneratedSection(
    begin=BEGIN, end=END, command=COMMAND, doc=ROOT / "docs" / "results.md", render=render,
    what="the UPipe-at-Ulysses-speed table", description=__doc__.splitlines()[0],
    results=ROOT / "results")
stale, main = SECTION.stale, SECTION.main


if __name__ == "__main__":
    sys.exit(main())
