"""spmdkit's benchmarks: run from the repository root as `python -m benchmarks.<name>`.

Each prints a table, writes JSON (and a PNG where a picture says more) under
``benchmarks/out/<name>/``; the figures and the commands that produced them are kept in
``benchmarks/RESULTS.md``.
"""
