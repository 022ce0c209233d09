"""What the protocols' own streams show: figures of a run and measures for a study's tables, one module per
stream family, each an analysis extension (p2p_emulator/analysis/extensions.py) that pyproject.toml names
under the entry-point group `p2p_emulator.analysis`.

A subpackage, so the protocol registry, which imports each module of `protocols`, imports only this file:
listing the protocols and running one never loads matplotlib; a report loads these modules through their
entry points.
"""
