"""Modules imported on first use, so that listing protocols and non-learning runs never load torch."""
from __future__ import annotations

import importlib


class LazyModule:
    """Stands for a module and imports it on the first attribute access.

    Unlike a lazy placeholder in sys.modules (importlib.util.LazyLoader), nothing
    else sees it: libraries that probe sys.modules for torch (matplotlib does, for
    every plotted array) would otherwise load it.
    """

    def __init__(self, name: str):
        self._name = name
        self._module = None

    def __getattr__(self, attr: str):
        if self._module is None:  # attribute access is hot (torch.x in every job): import once
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"

