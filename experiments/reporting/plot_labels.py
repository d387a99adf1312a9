"""How the plots name what they draw (experiments.reporting.plots): token counts ('128K'),
variants ('upipe U=8', 'usp 8x2', 'fpdt c=1K'), the settings that every row shares (for a
title) or that set rows apart (for a label), memory units, and the order variants are drawn in:
Ulysses first, then by method and U. The tables beside the plots label their rows the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd

from experiments.config.sizes import GiB, MiB

STACK_ORDER = ("none", "ac", "offload", "alst", "native")
SETTINGS = ("model", "nproc", "stack")  # a label names one of these only when it varies


# -- formatting ------------------------------------------------------------------------------


def format_tokens(n: float) -> str:
    """131072 -> '128K', 2**20 -> '1M', 5.5 * 2**20 -> '5.5M', 1392640 -> '1.33M'."""
    n = int(n)
    for unit, mult in (("M", 2**20), ("K", 2**10)):
        if n >= mult:
            v = n / mult
            return (f"{v:.0f}" if v.is_integer() or v >= 100 else f"{v:.3g}") + unit
    return str(n)


def is_given(v) -> bool:
    return v is not None and not pd.isna(v)


# Methods whose registry name alone would mislead a reader of the paper's tables: our fpdt is a
# stronger FPDT than the paper's (per-chunk output projection and RoPE tables, dK/dV accumulated
# on host, the ALST stack; baselines/fpdt.py), the paper's is DeepSpeed's (ds-fpdt).
METHOD_NAMES = {"fpdt": "fpdt (upipe's, ALST stack)", "ds-fpdt": "ds-fpdt (DeepSpeed's)"}


def variant_label(method: str, heads_per_stage: float | None = None,
                  ring_degree: float | None = None, chunk_size: float | None = None,
                  nproc: float | None = None, doc_len: float | None = None,
                  overlap: bool | None = None, *, names: bool = True,
                  chunk: bool = True) -> str:
    """A method and the options that make it a distinct variant (NaN/None: not set).

    ('upipe', 8.0) -> 'upipe U=8'; ('ulysses', nan) -> 'ulysses'; hybrids as Ulysses x ring
    degrees, the paper's notation: ('usp', nan, 2, nan, 16) -> 'usp 8x2'; FPDT's chunk in
    tokens: ('fpdt', nan, 1, 1024) -> 'fpdt c=1K'; packed documents by their length:
    ('upipe', nan, 1, nan, 4, 2048) -> 'upipe doc=2K'; UPipe's blocking schedule:
    ('upipe', nan, 1, nan, 8, nan, False) -> 'upipe no-overlap'. Without ``names`` (METHOD_NAMES'
    descriptions) and ``chunk``, a short name for an axis: 'fpdt'.
    """
    parts = [METHOD_NAMES.get(str(method), str(method)) if names else str(method)]
    if is_given(ring_degree) and ring_degree > 1:
        ring = int(ring_degree)
        parts.append(f"{int(nproc) // ring}x{ring}" if is_given(nproc) else f"ring={ring}")
    if is_given(heads_per_stage):
        parts.append(f"U={int(heads_per_stage)}")
    if is_given(chunk_size) and chunk:
        parts.append(f"c={format_tokens(chunk_size)}")
    if is_given(doc_len):
        parts.append(f"doc={format_tokens(doc_len)}")
    if is_given(overlap):
        parts.append("overlap" if bool(overlap) else "no-overlap")
    return " ".join(parts)


# what variant_label reads, in its order (nproc between: a setting, not a variant's option)
VARIANT = ("method", "heads_per_stage", "ring_degree", "chunk_size")
VARIANT_LAST = ("nproc", "doc_len", "overlap")


def column_of(df: pd.DataFrame, col: str) -> pd.Series:
    """``df[col]``, or NaN where the table has no such column (the ``hw_*`` columns exist in
    emulated tables only)."""
    return df[col] if col in df.columns else pd.Series(np.nan, index=df.index)


def plain_value(col: str, v) -> str:
    if col in ("seq_len", "max_seq_len"):
        return format_tokens(v)
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def format_number(v: float) -> str:
    """3 significant digits without exponents: 0.123, 12.3, 1,234."""
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def memory_unit(values: pd.Series) -> tuple[int, str]:
    """GiB when the largest value reaches 1 GiB (GPU-size numbers), else MiB: one unit a plot."""
    top = pd.to_numeric(values, errors="coerce").max()
    return (GiB, "GiB") if top >= GiB else (MiB, "MiB")


def is_emulated(df: pd.DataFrame) -> bool:
    """Every row says ``mode`` emulated (an emulated sweep's tables)."""
    return set(df["mode"].dropna()) == {"emulated"}


def mark_emulated(title: str, df: pd.DataFrame) -> str:
    """'Peak memory' -> 'Peak memory (emulated)' for emulated rows."""
    return f"{title} (emulated)" if is_emulated(df) else title


def shared_settings(df: pd.DataFrame, cols: Iterable[str] = (*SETTINGS, "device")) -> str:
    """The settings every row shares, for a title: 'llama3-8b · nproc 8 · stack alst · H100'."""
    parts = []
    for col in cols:
        vals = df[col].dropna().unique()
        if len(vals) == 1:
            parts.append(plain_value(col, vals[0]) if col in ("model", "device")
                         else f"{col} {plain_value(col, vals[0])}")
    return " · ".join(parts)


# -- labels and their order ------------------------------------------------------------------


def label_variants(df: pd.DataFrame, vary: Sequence[str] = SETTINGS
                   ) -> tuple[pd.DataFrame, list[str]]:
    """`df` with a `detail` column (the variant, plus each `vary` column that takes several
    values) and a `label` column, a short name for an axis: the variant without METHOD_NAMES'
    descriptions and the chunk, with the chunk where that names two variants, the detail where
    that still does; sorted Ulysses first, then by method and U; returns it and the label order.

    A `vary` column that is one value per variant (torch-cp on the ``native`` stack, the rest on
    ``alst``) is named only on the variants that differ from the most common value."""
    cols = [column_of(df, c) for c in (*VARIANT, *VARIANT_LAST)]
    shorter = [pd.Series([variant_label(*v, names=False, chunk=chunk)
                          for v in zip(*cols, strict=True)], index=df.index)
               for chunk in (False, True)]
    df = df.assign(label=[variant_label(*v) for v in zip(*cols, strict=True)])
    variant = df["label"].copy()
    for col in vary:
        if df[col].nunique() < 2:
            continue
        marked = pd.Series(True, index=df.index)
        if (df.groupby(variant)[col].nunique(dropna=False) == 1).all():
            marked = df[col] != df[col].mode().iloc[0]
        df.loc[marked, "label"] += [f", {col} {plain_value(col, v)}" for v in df.loc[marked, col]]
    short = shorter[0]
    for longer in (shorter[1], df["label"]):  # where a short label names several variants
        shared = df.groupby(short)["label"].transform("nunique") > 1
        short = short.where(~shared, longer)
    df = df.assign(detail=df["label"], label=short)
    keys = df.assign(_first=df["method"] != "ulysses", _u=df["heads_per_stage"].fillna(-1),
                     _r=df["ring_degree"].fillna(1), _c=df["chunk_size"].fillna(-1),
                     _d=column_of(df, "doc_len").fillna(-1),
                     stack=df["stack"].map(stack_rank))
    df = df.loc[keys.sort_values(["_first", "method", "_u", "_r", "_c", "_d", *vary],
                                 kind="stable").index]
    return df.reset_index(drop=True), list(dict.fromkeys(df["label"]))


def _details(df: pd.DataFrame, labels: list[str]) -> list[str]:
    """The detail (``label_variants``) of each label, for a legend."""
    detail = df.drop_duplicates("label").set_index("label")["detail"]
    return [detail[lb] for lb in labels]


def stack_rank(stack: str) -> int:
    return STACK_ORDER.index(stack) if stack in STACK_ORDER else len(STACK_ORDER)
