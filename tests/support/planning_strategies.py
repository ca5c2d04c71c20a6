"""Hypothesis strategies of the planner tests."""

from __future__ import annotations

from hypothesis import strategies as st

from autopipe import DeviceSpec

# Devices of every kind a plan meets: with and without memory limits, slower and faster,
# with free or costly links.
device_specs = st.builds(
    DeviceSpec,
    memory=st.one_of(st.none(), st.integers(2_000, 40_000)),
    speed=st.sampled_from([0.5, 1.0, 2.0]),
    bandwidth=st.one_of(st.none(), st.sampled_from([50.0, 500.0])),
    latency=st.sampled_from([0.0, 0.0, 0.5]),
)
