"""The mesh around the pipeline: validation and its place in a plan's JSON."""

from __future__ import annotations

import pytest

from autopipe.planning import MESH_DIMENSIONS, Mesh, Plan, evaluate
from profiler import LayerProfile, Profile


def _profile() -> Profile:
    layers = [
        LayerProfile(
            name=str(i), kind="Linear", forward=[1.0], backward=[2.0], saved=[8], output=[4]
        )
        for i in range(4)
    ]
    return Profile(layers=layers, batch_sizes=[1], input=[4], batch_size=4)


def test_the_default_mesh_is_the_pipeline_alone() -> None:
    mesh = Mesh()
    assert (mesh.tensor, mesh.context, mesh.zero, mesh.inner) == (1, 1, 0, 1)
    assert mesh.order == MESH_DIMENSIONS


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"tensor": 0}, "tensor degree is 0"),
        ({"context": 1.5}, "context degree is 1.5"),
        ({"zero": 4}, "zero is 4"),
        ({"per_node": -1}, "per_node is -1"),
        ({"sequence_parallel": True}, "needs a tensor-parallel degree"),
        ({"order": ("tp", "cp", "pp")}, "must name each of"),
        ({"expert": 0}, "expert degree is 0"),
        ({"expert": True}, "expert degree is True"),
    ],
)
def test_a_bad_mesh_is_refused_in_one_line(given: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Mesh(**given)  # type: ignore[arg-type]


def test_a_plan_keeps_its_mesh_through_json() -> None:
    plan = evaluate(_profile(), [2, 2], chunks=2)
    assert "mesh" not in plan.to_dict()  # plans of the pipeline alone read as before
    mesh = Mesh(tensor=4, context=2, sequence_parallel=True, zero=3, per_node=8)
    plan.mesh = mesh
    again = Plan.from_dict(plan.to_dict())
    assert again.mesh == mesh
    assert again.num_devices == plan.num_devices == 2 * 8


def test_a_plan_with_an_unknown_mesh_field_is_refused() -> None:
    data = evaluate(_profile(), [2, 2], chunks=2).to_dict()
    data["mesh"] = {"tensor": 2, "experts": 4}
    with pytest.raises(ValueError, match="mesh has unknown field 'experts'"):
        Plan.from_dict(data)


def test_an_expert_mesh_keeps_its_degree_and_a_dense_one_writes_none() -> None:
    plan = evaluate(_profile(), [2, 2], chunks=2)
    plan.mesh, plan.data_parallel = Mesh(tensor=2, zero=1), 4
    dense = plan.to_dict()
    assert "expert" not in dense["mesh"]  # meshes without experts read as before
    plan.mesh = Mesh(tensor=2, zero=1, expert=4)
    data = plan.to_dict()
    assert data["mesh"] == {**dense["mesh"], "expert": 4}
    again = Plan.from_dict(data)
    assert again.mesh.expert == 4 and again.num_devices == plan.num_devices == 2 * 4 * 2
    # Expert parallelism takes its devices from the replicas: t·D·c/e hold each expert.
    assert again.mesh.expert_replicas(4) == 2
    # A plan of version 5 (before expert parallelism) loads with e = 1.
    dense["version"] = 5
    assert Plan.from_dict(dense).mesh.expert == 1


def test_a_plan_whose_expert_degree_does_not_divide_its_replicas_is_refused() -> None:
    data = evaluate(_profile(), [2, 2], chunks=2).to_dict()
    data["data_parallel"], data["mesh"] = 2, {"context": 2, "expert": 8}
    with pytest.raises(ValueError, match=r"mesh expert 8 does not divide .* \(4\)"):
        Plan.from_dict(data)
