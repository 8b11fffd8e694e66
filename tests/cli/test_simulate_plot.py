"""`hybridkv simulate --plot`: the legend sits outside the axes, so it covers no curve."""

from __future__ import annotations

from pathlib import Path

from hybridkv.cli.simulate import memory_figure, write_memory_plot
from hybridkv.simulate.simulator import SimReport


def report(hits: int) -> SimReport:
    return SimReport(requests=1, prompt_tokens=100, hit_tokens=hits, ideal_tokens=100, generated_tokens=1, steps=1,
                     preemptions=0, lookups=1, max_running=1, mean_running=1.0, num_blocks=8, wall_s=0.0, groups=())


def curves() -> dict[str, list[tuple[float, SimReport | None]]]:
    # curves over the whole height at every budget: no place inside the axes is free of them
    return {"--preset vllm": [(1.0, report(0)), (2.0, report(50)), (4.0, report(100))],
            "--preset hybridkv": [(1.0, report(100)), (2.0, report(50)), (4.0, report(0))],
            "this run's flags": [(1.0, None), (2.0, report(10)), (4.0, report(90))]}


def test_legend_is_outside_the_axes() -> None:
    fig = memory_figure(curves(), model="m")
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == [*curves(), "infinite cache"]
    assert not legend.get_window_extent().overlaps(ax.get_window_extent())


def test_written_plot_keeps_the_legend_in_the_image(tmp_path: Path) -> None:
    out = tmp_path / "hits.png"
    write_memory_plot(curves(), out, model="m")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fig = memory_figure(curves(), model="m")
    fig.canvas.draw()
    saved = fig.get_tightbbox().transformed(fig.dpi_scale_trans)  # what bbox_inches="tight" keeps, in pixels
    legend = fig.axes[0].get_legend().get_window_extent()
    assert saved.y0 <= legend.y0 and legend.y1 <= saved.y1 and saved.x0 <= legend.x0 and legend.x1 <= saved.x1
