"""Solve-rate histograms of a curation run: a text one for the terminal and a PNG beside the output."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rltt.errors import RlttError


@dataclass(frozen=True)
class Band:
    """The kept solve-rate band ``low ≤ s ≤ high`` (inclusive; a tiny tolerance absorbs float noise)."""

    low: float = 0.1
    high: float = 0.9

    def __post_init__(self):
        if not 0.0 <= self.low <= self.high <= 1.0:
            raise RlttError(f"--band: need 0 <= LO <= HI <= 1, got {self.low},{self.high}")

    @classmethod
    def parse(cls, text: str) -> "Band":
        """``"0.1,0.9"`` → ``Band(0.1, 0.9)``."""
        parts = text.split(",")
        try:
            low, high = (float(p) for p in parts)
        except ValueError:
            raise RlttError(f"--band: expected LO,HI (e.g. 0.1,0.9), got {text!r}") from None
        return cls(low, high)

    def contains(self, rate: float) -> bool:
        return self.low - 1e-9 <= rate <= self.high + 1e-9

    def __str__(self) -> str:
        return f"{self.low:g} <= s <= {self.high:g}"


@dataclass
class Bin:
    """Prompts whose solve rate lies in ``[low, high]`` (one exact value when ``low == high``)."""

    low: float
    high: float
    count: int
    in_band: bool

    @property
    def label(self) -> str:
        return f"{self.low:.3f}" if self.low == self.high else f"{self.low:.2f}-{self.high:.2f}"


def solve_rate_bins(rates: list[float], samples: int, band: Band, max_exact: int = 20) -> list[Bin]:
    """Counts per possible solve rate k/samples when ``samples ≤ max_exact``, else 10 equal bins."""
    if samples <= max_exact:
        counts = [0] * (samples + 1)
        for rate in rates:
            counts[round(rate * samples)] += 1
        return [Bin(k / samples, k / samples, c, band.contains(k / samples)) for k, c in enumerate(counts)]
    counts = [0] * 10
    for rate in rates:
        counts[min(int(rate * 10), 9)] += 1
    return [Bin(i / 10, (i + 1) / 10, c, band.contains((i + 0.5) / 10)) for i, c in enumerate(counts)]


def text_histogram(bins: list[Bin], width: int = 40) -> str:
    """One line per bin: label, ``*`` when in the band, a bar scaled to ``width`` and the count."""
    peak = max((b.count for b in bins), default=0) or 1
    lines = ["solve rate  band  prompts"]
    for b in bins:
        bar = "#" * (round(width * b.count / peak) if b.count else 0)
        lines.append(f"{b.label:>10}  {'*' if b.in_band else ' ':^4}  {bar} {b.count}")
    return "\n".join(lines)


def plot_histogram(path: str | Path, bins: list[Bin], band: Band, title: str = "") -> Path:
    """Draw the bins as a PNG at ``path`` (kept bins highlighted, the band shaded)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    fig = Figure(figsize=(6.4, 3.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    centers = [(b.low + b.high) / 2 for b in bins]
    widths = [(b.high - b.low) or (1 / max(len(bins) - 1, 1)) for b in bins]
    ax.axvspan(band.low, band.high, color="tab:green", alpha=0.12, label=f"kept band ({band})")
    ax.bar(centers, [b.count for b in bins], width=[0.85 * w for w in widths],
           color=["tab:green" if b.in_band else "tab:gray" for b in bins])
    ax.set_xlabel("solve rate")
    ax.set_ylabel("prompts")
    ax.set_xlim(-0.06, 1.06)
    ax.set_title(title or "solve rate per prompt")
    ax.legend(loc="upper center", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
