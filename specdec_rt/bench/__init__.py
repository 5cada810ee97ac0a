"""Benchmarks: specdec-rt against peer systems on the same checkpoints and prompts."""
