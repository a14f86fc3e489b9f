"""Figures and how they are printed: ``name: median (min X, max Y, N rounds)``.

Every figure is kept with all its samples, so the summary's ratios are computed from the
medians, and a reader sees the spread a noisy machine gave each one.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass, field


def fmt(value: float) -> str:
    """Whole numbers for rates and milliseconds, two decimals for ratios and small values."""
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


@dataclass
class Figure:
    name: str
    samples: list[float] = field(default_factory=list)
    per: str = "rounds"  # what one sample is: a round, an RSS sample after warm-up
    note: str = ""  # printed after the spread: the setting a figure was taken at
    pending: str | None = None  # why there is no value (a workload that could not run)
    counted: bool = True  # False: its absence does not fail the run (a peer this machine cannot build)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples and self.pending is None else None

    def line(self) -> str:
        if self.value is None:
            return f"{self.name}: pending ({self.pending or 'no samples'})"
        spread = f"min {fmt(min(self.samples))}, max {fmt(max(self.samples))}, {len(self.samples)} {self.per}"
        note = f" [{self.note}]" if self.note else ""
        return f"{self.name}: {fmt(self.value)} ({spread}){note}"


class Report:
    """Collects figures in order and prints each line as soon as it is known."""

    def __init__(self, out=None) -> None:
        self.out = out or sys.stdout
        self.figures: dict[str, Figure] = {}
        self.durability = ""  # the ledger's durability, appended to every figure's note

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def add(self, figure: Figure) -> Figure:
        if self.durability:
            figure.note = f"{figure.note}; {self.durability}" if figure.note else self.durability
        self.figures[figure.name] = figure
        self.say(figure.line())
        return figure

    def value(self, name: str) -> float | None:
        figure = self.figures.get(name)
        return figure.value if figure else None

    def missing(self, names: list[str]) -> list[str]:
        return [
            name
            for name in names
            if self.value(name) is None and (name not in self.figures or self.figures[name].counted)
        ]
