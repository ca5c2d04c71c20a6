"""Tests of the benchmarks' own code: the model zoo, the balance suite, the accuracy report."""
