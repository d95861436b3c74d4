"""`hpcrun report`: one self-contained HTML page of a sweep's results (hpcrun.report.page), its
plots (figures) and its numbers in human units (units)."""

from hpcrun.report.page import render, report

__all__ = ["render", "report"]
