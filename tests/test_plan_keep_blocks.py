"""``upipe-bench plan``'s configurations keeping whole blocks (``alst-block``) in their last k
blocks only (docs/emulation.md#the-planner): a candidate for every configuration whose alst
row fits, and a candidate over the device leading nothing. The emulator is a stand-in with
peaks and step times linear in the blocks kept (the reviewer's probes), so each test is a plan
of tiny in well under a second."""

from __future__ import annotations

from experiments.config import GiB, Hardware, Status
from experiments.harness.launch import describe
from experiments.runner import plan_keep, plan_ladder
from experiments.runner.plan import plan
from experiments.runner.plan_spec import PlanSpec

HW = Hardware()  # an H100: 73.35 GiB of budget after the default reserve
BLOCKS_GIB = 40.0  # what keeping every block whole adds to the device peak


def _row(cell, hw, peak_gib: float, step: float) -> dict:
    """An emulated row: over the device budget (OOM) or fitting, with its time either way."""
    row = describe(cell, cell.validate()) | {
        "peak_device_bytes": int(peak_gib * GiB), "peak_host_bytes": 0, "step_time_s": step,
        "tokens_per_s_per_gpu": cell.seq_len / cell.world / step}
    budget = hw.device_budget(cell)
    if peak_gib * GiB > budget:
        return row | {"status": Status.OOM,
                      "error": f"device peak {peak_gib:.2f} GiB > budget {budget / GiB:.2f} GiB"}
    return row | {"status": Status.OK, "error": ""}


def _emulator(base_peak, base_step, extra_gib=lambda cell: 0.0):
    """``emulate_cell``'s stand-in: alst at ``base_peak(cell)`` GiB and ``base_step(cell)`` s;
    alst-block keeping k of N blocks adds k / N of ``BLOCKS_GIB`` and saves k / N of a fifth of
    the step, plus ``extra_gib(cell)`` for a cell keeping some blocks (where the chord's
    estimate of k falls short). Records the cells it emulates."""
    emulated = []

    def emulate(cell, hw, exact=False, count=True, bound_first=False):
        emulated.append(cell)
        n = cell.validate().n_layers
        peak, step = base_peak(cell), base_step(cell)
        if cell.stack == "alst-block":
            share = (cell.keep_blocks or n) / n
            peak += share * BLOCKS_GIB + (extra_gib(cell) if cell.keep_blocks else 0.0)
            step -= share * 0.2 * step
        return _row(cell, hw, peak, step)

    emulate.emulated = emulated
    return emulate


def _kept(rows: list[dict]) -> dict[tuple, dict]:
    """(ring degree, U, overlap) -> the row keeping some blocks."""
    return {(r["ring_degree"], r["heads_per_stage"], bool(r.get("overlap"))): r
            for r in rows if r.get("keep_blocks")}


def test_every_configuration_whose_alst_fits_gets_a_keep_blocks_candidate(monkeypatch):
    """Every U of a mesh fits on alst, more U faster; keeping every block is over the device
    for all. The smallest U's alst-block row over the device used to spare the larger U's
    (as a larger U keeps more): their rows had no time, so the fastest, U = 16 keeping its
    last block, was never weighed. Now each has its alst-block row and candidate, and U = 16's
    is emulated and fits."""
    fake = _emulator(lambda c: 40.0 + c.option("heads_per_stage"),
                     lambda c: 100.0 - c.option("heads_per_stage"))
    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", fake)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst", "alst-block"),
                    ring_degrees=(1,))
    rows = plan(spec, HW, workers=1)
    whole = [r for r in rows if r["stack"] == "alst-block" and not r.get("keep_blocks")]
    assert all(r["status"] == Status.OOM and "plan_inferred_from" not in r for r in whole)
    kept = _kept(rows)
    assert set(kept) == {(1, 4, False), (1, 4, True), (1, 8, False), (1, 16, False)}
    assert kept[1, 16, False]["status"] == Status.OK and kept[1, 16, False]["keep_blocks"] == 1
    assert rows[0] is kept[1, 16, False]  # the plan's answer
    assert all(kept[k]["status"] == Status.SKIPPED for k in kept if k != (1, 16, False))


def _over_on_ring_1(cell) -> float:
    """The chord's k is 5 GiB short of the exact peak on the plain Ulysses mesh."""
    return 5.0 if cell.ring_degree == 1 else 0.0


def _default_u_only(ring_gib: float):
    """alst fits at the default U (the Ulysses degree) only: ``50 + ring_gib x (ring - 1)``."""
    def peak(cell):
        off = cell.option("overlap") or cell.option("heads_per_stage") != 4 // cell.ring_degree
        return 50.0 + ring_gib * (cell.ring_degree - 1) + (30.0 if off else 0.0)
    return peak


def test_a_candidate_over_the_device_does_not_bar_its_method_and_level(monkeypatch):
    """Ring degree 1 keeping k = 2 (the chord's) comes back over the device: it used to lead
    its method and level all the same, so ring degree 2's candidate (the fastest left, and
    one that fits) was a row "below the configuration ... emulated on this level". Now it is
    emulated and leads."""
    fake = _emulator(_default_u_only(1.0), lambda c: 100.0 + (c.ring_degree - 1),
                     _over_on_ring_1)
    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", fake)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst", "alst-block"),
                    ring_degrees=(1, 2))
    rows = plan(spec, HW, workers=1)
    tried = [(c.ring_degree, c.keep_blocks) for c in fake.emulated if c.keep_blocks]
    assert tried == [(1, 2), (2, 2)]
    by = {(r["ring_degree"], r["keep_blocks"]): r for r in rows if r.get("keep_blocks")}
    assert by[1, 2]["status"] == Status.OOM and by[2, 2]["status"] == Status.OK
    # ring degree 1 keeping fewer blocks, estimated below ring degree 2's fit: a row saying so
    assert by[1, 1]["status"] == Status.SKIPPED
    assert "k2 was over the device budget when emulated" in by[1, 1]["error"]
    assert "below upipe on alst-block k2, U=2, ring degree 2, which fits" in by[1, 1]["error"]


def test_a_candidate_over_the_device_is_tried_again_with_fewer_blocks(monkeypatch):
    """One mesh: its k = 2 over the device by 5 GiB, the exact peak's secant gives k = 1,
    which is emulated and fits."""
    fake = _emulator(_default_u_only(1.0), lambda c: 100.0, _over_on_ring_1)
    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", fake)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst", "alst-block"),
                    ring_degrees=(1,))
    rows = plan(spec, HW, workers=1)
    assert [c.keep_blocks for c in fake.emulated if c.keep_blocks] == [2, 1]
    assert [(r["keep_blocks"], r["status"]) for r in rows if r.get("keep_blocks")] == [
        (1, Status.OK), (2, Status.OOM)]
    assert rows[0]["keep_blocks"] == 1  # the plan's answer


def test_no_candidate_below_one_block(monkeypatch):
    """Over the device even by the exact secant's one block: no further candidate, and the
    plan ends (no loop)."""
    fake = _emulator(_default_u_only(1.0), lambda c: 100.0, lambda c: 35.0)
    for module in (plan_ladder, plan_keep):
        monkeypatch.setattr(module, "emulate_cell", fake)
    spec = PlanSpec("tiny", 4, 4096, methods=("upipe",), stacks=("alst", "alst-block"),
                    ring_degrees=(1,))
    rows = plan(spec, HW, workers=1)
    assert [c.keep_blocks for c in fake.emulated if c.keep_blocks] == [2]
    assert [r["status"] for r in rows if r.get("keep_blocks")] == [Status.OOM]
