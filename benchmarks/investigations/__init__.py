"""One-off performance investigations, kept runnable: each module's first line says what it found.

  python -m benchmarks.investigations.<module> --help

They are not part of `make bench` (`benchmarks/run.py` runs the figures) nor
of CI; what each found, with its runs, is in docs/engineering-log.md.
"""
