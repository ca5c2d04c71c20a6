"""Benchmarks of autopipe, one folder per family; results go to benchmarks/results/."""
