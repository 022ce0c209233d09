"""Figures and measures that installed packages add to the analysis, found through entry points.

An analysis extension is an `Extension` named by an entry point of the group
`p2p_emulator.analysis` (`name = "package.module:EXTENSION"`). Its figures are drawn by
`plot_run` after the built-in ones, for every run (a figure function yields nothing for a
run without its input); its measures may be named in a study's `table: metric:`. This
repository's protocols ship their figures and measures the same way (protocols/analysis/),
so the analysis reads run directories and imports none of them. An extension that fails to
load costs one warning line; the built-in figures and measures still work.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable, Mapping

from .drawing import Figures
from .measures import Measure
from .rundir import Run

GROUP = "p2p_emulator.analysis"
FigureMaker = Callable[[Run], Figures]  # a run -> (file name under RUN_DIR/plots, figure) per figure it has input for


@dataclass(frozen=True)
class Extension:
    """What a package adds: figures of one run, and measures by the name a study's `table: metric:` gives them."""
    figures: tuple[FigureMaker, ...] = ()
    measures: Mapping[str, Measure] = field(default_factory=dict)


class ExtensionWarning(UserWarning):
    """An installed analysis extension could not be loaded; the built-in figures and measures still work."""


@functools.cache  # once per process: a broken extension is reported once
def extensions() -> tuple[Extension, ...]:
    """The installed extensions that load, by entry-point name."""
    loaded = []
    for entry in sorted(entry_points(group=GROUP), key=lambda entry: entry.name):
        try:
            extension = entry.load()
            if not isinstance(extension, Extension):
                raise TypeError(f"{extension!r} is not a p2p_emulator.analysis.extensions.Extension")
            loaded.append(extension)
        except Exception as exc:  # any failure of someone else's code: name it, keep the built-in analysis
            message = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"analysis extension {entry.name!r} ({entry.value}) not loaded: {message}", ExtensionWarning)
    return tuple(loaded)


def extension_figures() -> list[FigureMaker]:
    """Every installed extension's figure functions."""
    return [figures for extension in extensions() for figures in extension.figures]


def extension_measures() -> dict[str, Measure]:
    """Every installed extension's measures by name."""
    return {name: measure for extension in extensions() for name, measure in extension.measures.items()}
