"""Every committed plot, redrawn from its committed tables, sets no text on top of other text.

The plots under ``results/`` are redrawn by the functions that wrote them (a sweep's
``draw_plots`` with the plots its ``sweep.json`` names, the reproduction report's figures, the
time model's validation plots), without saving: ``Figure.savefig`` only lays the figure out and
draws it on the Agg canvas. Every text drawn (tick labels, annotations, titles, legend texts)
is recorded as it draws, and no two visible, non-empty text boxes of one figure may intersect.
The test also checks that it redrew every PNG committed under ``results/``.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from experiments.reporting import reproduction_report
from experiments.reporting.plots import draw_plots
from experiments.reporting.reproduction import OUT_DIR
from experiments.reporting.tables import MAXCTX, ROWS
from experiments.reporting.validation import plot_gpu_validation, plot_predicted_vs_measured

RESULTS = Path(__file__).resolve().parents[1] / "results"
SLACK = 0.5  # pixels: boxes that only touch do not overlap


def _sweeps() -> list[str]:
    """Sweep directories with tables and plots to draw."""
    return sorted(p.parent.name for p in RESULTS.glob("*/sweep.json")
                  if (p.parent / ROWS).exists() and json.loads(p.read_text()).get("plots"))


def _draw_sweep(name: str, out: Path) -> None:
    d = out / name
    d.mkdir()
    for table in (ROWS, MAXCTX):
        if (RESULTS / name / table).exists():
            shutil.copy(RESULTS / name / table, d / table)
    draw_plots(d, json.loads((RESULTS / name / "sweep.json").read_text())["plots"])


def _draw_paper_grid(out: Path) -> None:
    reproduction_report.write(RESULTS, out / OUT_DIR)


def _draw_time_validation(out: Path) -> None:
    cpu = RESULTS / "time_validation_cpu"
    plot_predicted_vs_measured(pd.read_csv(cpu / "comparison.csv"),
                               out / cpu.name / "predicted_vs_measured.png")
    for gpu in (RESULTS / "time_validation_gpu", RESULTS / "time_validation_gpu_sdpa"):
        env = json.loads((gpu / "env.json").read_text())
        profiles = list(env.get("repriced", env)["profiles"])  # a repriced run's, else its own
        plot_gpu_validation(pd.read_csv(gpu / ROWS), profiles,
                            out / gpu.name / "predicted_vs_measured.png")


class Recorder:
    """Stands in for ``Figure.savefig``: draws the figure as saving would (tight layout, Agg)
    and keeps, per path, the window extents of the texts that drew."""

    def __init__(self, out: Path):
        self.out = out
        self.figures: dict[str, list[tuple[str, object]]] = {}
        self._drawn: list[Text] | None = None

    def savefig(self, fig: Figure, path, *args, **kwargs) -> None:
        canvas = FigureCanvasAgg(fig)
        self._drawn = []
        canvas.draw()
        renderer = canvas.get_renderer()
        texts = [(t.get_text(), t.get_window_extent(renderer)) for t in self._drawn]
        self._drawn = None
        self.figures[Path(path).relative_to(self.out).as_posix()] = texts

    def text_draw(self, original):
        recorder = self

        def draw(text: Text, renderer) -> None:
            if (recorder._drawn is not None and text.get_visible()
                    and text.get_text().strip()):
                recorder._drawn.append(text)
            original(text, renderer)
        return draw


@pytest.fixture(scope="module")
def drawn(tmp_path_factory) -> dict[str, list]:
    out = tmp_path_factory.mktemp("plots")
    rec = Recorder(out)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Figure, "savefig", lambda fig, path, *a, **k: rec.savefig(fig, path))
        mp.setattr(Text, "draw", rec.text_draw(Text.draw))
        for name in _sweeps():
            _draw_sweep(name, out)
        _draw_paper_grid(out)
        _draw_time_validation(out)
    return rec.figures


def overlaps(texts: list[tuple[str, object]]) -> list[str]:
    """Pairs of texts whose boxes intersect (by more than SLACK pixels each way)."""
    out = []
    for (a, ba), (b, bb) in itertools.combinations(texts, 2):
        if (min(ba.x1, bb.x1) - max(ba.x0, bb.x0) > SLACK
                and min(ba.y1, bb.y1) - max(ba.y0, bb.y0) > SLACK):
            out.append(f"{a!r} / {b!r}")
    return out


@pytest.mark.slow  # about 6 s on 2 cores (docs/testing.md)
def test_every_committed_plot_is_redrawn(drawn):
    committed = {p.relative_to(RESULTS).as_posix() for p in RESULTS.glob("*/*.png")}
    assert set(drawn) == committed


@pytest.mark.slow  # shares the ~6 s of redrawing every committed plot (the fixture)
def test_no_text_overlaps_other_text(drawn):
    bad = {path: pairs for path, texts in sorted(drawn.items()) if (pairs := overlaps(texts))}
    assert not bad, "\n".join(f"{path}: {'; '.join(pairs[:6])}" + (
        f" (+{len(pairs) - 6} more)" if len(pairs) > 6 else "") for path, pairs in bad.items())


def test_overlaps_finds_text_over_text():
    """The check fails on boxes that intersect, not on boxes that only touch or stand apart."""
    a, b, c = Bbox([[0, 0], [10, 10]]), Bbox([[9, 9], [20, 20]]), Bbox([[10, 0], [20, 8]])
    assert overlaps([("a", a), ("b", b)]) == ["'a' / 'b'"]
    assert overlaps([("a", a), ("c", c)]) == []
