"""Benchmarks: each script measures figures an issue asks for and writes ``benchmarks/results/NAME.json``."""
