"""`hybridkv plan --plot`: capacity against context length, hybrid layout vs uniform layout.

`capacity_curves` runs the planner (through `plan_report.make_plan`) once per model and length
and returns plain numbers; `write_capacity_plot` draws them. matplotlib is imported inside
`write_capacity_plot` only, so `hybridkv plan` without `--plot` never loads it.

    max concurrency (log)
      |  ----___                 solid:  hybrid layout (one curve per model)
      |  - - -___---___          dashed: uniform layout (absent when the model can't run uniformly)
      +---------------------- max_model_len (log2): 1K 2K 4K ... 128K, capped at the model's limit
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridkv.cli.plan_report import PlanRequest, make_plan
from hybridkv.errors import ConfigError

DEFAULT_LENGTHS_TOKENS: tuple[int, ...] = tuple(1024 * 2**i for i in range(8))  # 1K .. 128K


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    """One model's capacity at each plotted max_model_len.

    `hybrid[i]` and `uniform[i]` are the planner's max concurrency (requests of
    `lengths_tokens[i]` tokens that fit at once); `uniform` is None when the model cannot run
    with the uniform layout (Mamba-style state layers, or a budget below two blocks).
    """

    name: str  # short model name (the part after the last "/")
    lengths_tokens: tuple[int, ...]
    hybrid: tuple[float, ...]
    uniform: tuple[float, ...] | None

    def __post_init__(self) -> None:
        if not self.lengths_tokens:
            raise ConfigError(f"curve {self.name!r} has no lengths")
        if len(self.hybrid) != len(self.lengths_tokens) or (
            self.uniform is not None and len(self.uniform) != len(self.lengths_tokens)
        ):
            raise ConfigError(
                f"curve {self.name!r}: {len(self.lengths_tokens)} lengths but {len(self.hybrid)} hybrid and "
                f"{'no' if self.uniform is None else len(self.uniform)} uniform values; expected one per length"
            )


def capacity_curves(
    requests: Sequence[PlanRequest], lengths_tokens: Sequence[int] = DEFAULT_LENGTHS_TOKENS
) -> list[Curve]:
    """One curve per request, planned at each length capped at the model's `max_position_embeddings`.

    Each request's own `max_model_len` is ignored: the lengths are the x axis. Lengths above a
    model's limit collapse onto the limit, so a curve ends exactly there. Raises what
    `make_plan` raises (`HybridKVError` subclasses) for an unknown model or an impossible budget.
    """
    if not lengths_tokens or any(n <= 0 for n in lengths_tokens):
        raise ConfigError(f"plot lengths must be positive token counts, got {list(lengths_tokens)}")
    curves = []
    for request in requests:
        spec, _ = make_plan(dataclasses.replace(request, max_model_len=min(lengths_tokens)))
        lengths = sorted({min(n, spec.max_position_embeddings) for n in lengths_tokens})
        plans = [make_plan(dataclasses.replace(request, max_model_len=n))[1] for n in lengths]
        runnable = all(p.uniform.max_concurrency > 0 for p in plans)  # log axis: below 1 request is drawn
        curves.append(Curve(
            name=spec.name.split("/")[-1], lengths_tokens=tuple(lengths),
            hybrid=tuple(p.max_concurrency for p in plans),
            uniform=tuple(p.uniform.max_concurrency for p in plans) if runnable else None,
        ))
    return curves


def write_capacity_plot(curves: Sequence[Curve], path: Path, *, memory_gib: float) -> None:
    """Write a picture of `curves` to `path` (PNG, SVG or PDF by its suffix).

    Solid = hybrid, dashed = uniform, one colour per model."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    legend_rows = len(curves)  # two entries per model, two columns
    fig = Figure(figsize=(9, 5.5 + 0.22 * legend_rows), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)  # Agg draws the PNG; no pyplot, no global backend state
    ax = fig.add_subplot()
    for i, curve in enumerate(curves):
        color = f"C{i % 10}"
        ax.plot(curve.lengths_tokens, curve.hybrid, color=color, linestyle="-", marker="o", markersize=4,
                label=f"{curve.name}: hybrid")
        if curve.uniform is not None:
            ax.plot(curve.lengths_tokens, curve.uniform, color=color, linestyle="--", marker="o", markersize=3,
                    markerfacecolor="none", label=f"{curve.name}: uniform")
        else:
            ax.add_line(Line2D([], [], color=color, linestyle="none",
                               label=f"{curve.name}: uniform can't run (no dashed line)"))
    ticks = sorted({n for c in curves for n in c.lengths_tokens})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: _tokens_label(round(x))))
    ax.set_yscale("log")
    ax.axhline(1.0, color="0.6", linewidth=0.8, linestyle=":")
    ax.annotate("1 request", xy=(ticks[0], 1.0), xytext=(2, 2), textcoords="offset points", fontsize="x-small",
                color="0.4", va="bottom")
    ax.set_xlabel("max_model_len (tokens, log2 scale)")
    ax.set_ylabel("max concurrency (full-length requests, log scale)")
    ax.set_title(f"KV cache capacity at {memory_gib:g} GiB: hybrid (solid) vs uniform (dashed) layout")
    ax.grid(True, which="both", linewidth=0.4, alpha=0.5)
    # Below the axes, so the legend never hides a curve however many models are drawn.
    fig.legend(fontsize="small", loc="outside lower center", ncols=2)
    fig.savefig(path, format=path.suffix.lower().removeprefix(".") or "png")


def _tokens_label(n: int) -> str:
    """1024 -> "1K", 131072 -> "128K", 40960 -> "40K", 1000 -> "1000"."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)
