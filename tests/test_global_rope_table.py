"""The paper's TorchTitan RoPE table (``Cell.global_rope_table``, docs/design.md#the-comparison):
what it holds, and that a cell holding it allocates exactly its bytes more, counted as
``other``, and nothing else. Its real-run twin is a case of tests/test_emulate.py."""

from __future__ import annotations

import math

import pytest
import torch
from cell_runs import emulated_on_cpu, equality_cell

from experiments.cli import parser
from experiments.cli_args import cell_from_args
from experiments.config import Cell, resolve_model
from experiments.harness.model import global_rope_table
from experiments.runner.max_context_guard import entries
from experiments.runner.search import summarize
from experiments.sweeps import SWEEPS
from upipe.rope import rope_tables


def test_the_table_holds_every_position_of_the_global_sequence():
    """complex64 (S, head_dim / 2): 512 bytes a token on Llama3-8B (1.5 GiB at 3M tokens), the
    angle p x theta^(-2j/d) at position p and frequency j, as TorchTitan's
    precompute_freqs_cis makes it; the same angles the methods' own RoPE rotates by."""
    cfg = resolve_model("llama3-8b")  # head_dim 128, rope_theta 500000
    table = global_rope_table(cfg, 1000, torch.device("cpu"))
    assert table.dtype == torch.complex64 and table.shape == (1000, 64)
    assert table.untyped_storage().nbytes() == 1000 * 512  # x 3M tokens: 1.5 GiB
    for p, j in ((0, 0), (1, 0), (999, 0), (999, 1), (517, 63)):
        angle = p * 500000.0 ** (-2 * j / 128)  # by hand, in fp64
        # fp32 angles, as TorchTitan's: 999 rad is exact to 6e-5 of a radian
        assert table[p, j].item() == pytest.approx(complex(math.cos(angle), math.sin(angle)),
                                                   abs=1e-4), (p, j)
    cos, sin = rope_tables(torch.arange(1000), 128, 500000.0, torch.float32)
    torch.testing.assert_close(table.real, cos[:, :64], rtol=0, atol=1e-6)
    torch.testing.assert_close(table.imag, sin[:, :64], rtol=0, atol=1e-6)


@pytest.mark.slow  # about 1-2 s on 2 cores (docs/testing.md)
def test_a_cell_holding_the_table_allocates_its_bytes_as_other_and_nothing_else():
    """The exact emulation of a tiny cell (head_dim 16: 64 bytes a token) with and without the
    table: the device peak and its ``other`` part grow by the table's bytes, to the byte; the
    model states, the attention and the host do not change."""
    without = emulated_on_cpu(equality_cell("upipe", "alst", {}, 4))  # 2048 tokens
    held = emulated_on_cpu(equality_cell("upipe", "alst", {"global_rope_table": True}, 4))
    table = 2048 * resolve_model("tiny").head_dim // 2 * 8
    assert held["status"] == without["status"] == "ok"
    assert held["peak_device_bytes"] - without["peak_device_bytes"] == table == 131072
    assert held["peak_other_bytes"] - without["peak_other_bytes"] == table
    for key in ("peak_model_bytes", "peak_attention_bytes", "peak_host_bytes", "peak_phase"):
        assert held[key] == without[key], key
    assert held["global_rope_table"] is True and without["global_rope_table"] is False


def test_the_flag_reaches_the_cell_and_a_search_says_so():
    """``--global-rope-table`` sets the field (the id says ``-rope``); a search's summary carries
    it where set and, as the summaries committed before the field, not where unset."""
    a = parser().parse_args(["emulate", "--method", "upipe", "--model", "tiny", "--world", "4",
                             "--global-rope-table"])
    cell = cell_from_args(a, emulated=True)
    assert cell.global_rope_table is True and "-alst-rope-bf16-" in cell.cell_id()
    plain = parser().parse_args(["emulate", "--method", "upipe", "--model", "tiny"])
    assert cell_from_args(plain, emulated=True).global_rope_table is False
    res = {"status": "ok", "max_seq_len": 4096, "first_failing_seq_len": 8192, "probes": []}
    assert summarize(cell, res)["global_rope_table"] is True
    assert "global_rope_table" not in summarize(Cell("upipe"), res)


PAPER_SWEEPS = ("table3_llama3_8b_h100x8", "table4_qwen3_32b_h100x16",
                "memory_wall_llama3_8b_h100x8", "two_node_llama3_8b_h100x16")


def test_the_papers_sweeps_hold_it_where_the_paper_ran_torchtitan():
    """Every cell of the paper's sweeps (and each search's) holds the table but DeepSpeed's
    FPDT's (Megatron-DeepSpeed); no CPU counterpart, other sweep or CI guard row does."""
    for name, sweep in SWEEPS.items():
        cells = sweep.cells() + sweep.search_cells()
        paper = sweep.scale != "cpu" and name.removesuffix("-emulated") in PAPER_SWEEPS
        assert cells, name
        for cell in cells:
            assert cell.global_rope_table == (paper and cell.method != "ds-fpdt"), cell.cell_id()
    assert not any(e.base.global_rope_table for e in entries())
