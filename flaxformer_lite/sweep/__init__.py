"""Grids of runs: a spec of config overrides x seeds, run as subprocesses, resumable,
and tabulated. May import every layer below it; only ``main`` imports it.
"""
