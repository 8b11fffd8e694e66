"""`hybridkv simulate --plot`: hit rate and prompt tokens computed against memory; the legend sits
outside both axes, so it covers no curve."""

from __future__ import annotations

from pathlib import Path

from hybridkv.cli.simulate import memory_figure, write_memory_plot
from hybridkv.simulate.simulator import SimReport


def report(hits: int, recomputed: int = 0) -> SimReport:
    return SimReport(requests=1, prompt_tokens=100, hit_tokens=hits, ideal_tokens=100, generated_tokens=1, steps=1,
                     preemptions=0, lookups=1, max_running=1, mean_running=1.0, num_blocks=8, wall_s=0.0, groups=(),
                     prefill_tokens=100 - hits + recomputed)


def curves() -> dict[str, list[tuple[float, SimReport | None]]]:
    # curves over the whole height at every budget: no place inside the axes is free of them
    return {"--preset vllm": [(1.0, report(0)), (2.0, report(50)), (4.0, report(100))],
            "--preset hybridkv": [(1.0, report(100)), (2.0, report(50)), (4.0, report(0))],
            "this run's flags": [(1.0, None), (2.0, report(10)), (4.0, report(90))]}


def test_legend_is_outside_the_axes() -> None:
    fig = memory_figure(curves(), model="m")
    fig.canvas.draw()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [*curves(), "infinite cache"]
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert not legend.get_window_extent().overlaps(ax.get_window_extent())


def test_second_panel_is_prompt_tokens_computed_per_prompt_token() -> None:
    # a budget whose first-admission hits are high but whose preemptions recompute: 90 hits + 150 recomputed
    curve = {"p": [(1.0, report(90, recomputed=150)), (2.0, report(50))]}
    fig = memory_figure(curve, model="m")
    hits, computed = fig.axes
    assert list(hits.lines[0].get_ydata()) == [0.9, 0.5]
    assert list(computed.lines[0].get_ydata()) == [(10 + 150) / 100, 50 / 100]  # by hand: prefill / prompt
    assert list(computed.lines[1].get_ydata()) == [0.0, 0.0]  # the infinite cache computes 100 - 100


def test_written_plot_keeps_the_legend_in_the_image(tmp_path: Path) -> None:
    out = tmp_path / "hits.png"
    write_memory_plot(curves(), out, model="m")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = memory_figure(curves(), model="m")
    fig.canvas.draw()
    saved = fig.get_tightbbox().transformed(fig.dpi_scale_trans)  # what bbox_inches="tight" keeps, in pixels
    legend = fig.legends[0].get_window_extent()
    assert saved.y0 <= legend.y0 and legend.y1 <= saved.y1 and saved.x0 <= legend.x0 and legend.x1 <= saved.x1
