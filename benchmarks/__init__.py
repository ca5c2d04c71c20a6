"""Benchmarks of autopipe: planning speed, balance quality and executor overhead."""
