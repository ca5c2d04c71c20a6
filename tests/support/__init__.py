"""Models, workers and helpers the tests share."""
