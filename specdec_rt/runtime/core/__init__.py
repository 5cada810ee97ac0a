"""The vocabulary every runtime layer shares: the bundle on disk and its manifest, the tokenizer,
generation defaults, rows and the reports drafters and policies receive, the sampling and
acceptance rules, statistics, attention masks and memory readings.

Imports nothing of the runtime above it (only :mod:`specdec_rt.errors` and third-party packages).
"""
