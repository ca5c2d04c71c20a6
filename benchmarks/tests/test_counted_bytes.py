"""The benchmark zoo's counted bytes equal its measured ones, unit by unit."""

from __future__ import annotations

import pytest
import torch

from autopipe.cli.model_file import as_sequential
from benchmarks.models import ZOO
from tests.support.counted import byte_differences, counted_and_measured


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_counts_what_it_measures(name: str) -> None:
    torch.manual_seed(0)
    model = ZOO[name].model()
    layers, flat = as_sequential(model, ZOO[name].sample())
    # Two micro-batches: the sizes measured are a quarter and half of the mini-batch.
    counted, measured = counted_and_measured(layers, tuple(flat), chunks=2)
    assert byte_differences(counted, measured) == {}
    assert len(counted.layers) == len(layers) >= 4
