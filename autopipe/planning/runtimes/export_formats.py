"""A plan's split as other runtimes take it: torch pipeline(), torchtitan, Megatron, DeepSpeed."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autopipe.planning.model.plans import Plan

__all__ = ["check_export_format"]

# The model's own code, outside every module (a unit of no module call).
_OWN_CODE = "forward"
_PATH = re.compile(r"[^\s.#+]+(\.[^\s.#+]+)*")
_TORCH_CALL = "torch.distributed.pipelining.pipeline(module, mb_args, split_spec=...)"


@dataclass(frozen=True)
class _Call:
    """One module call of a unit: the module's dotted name and which of its calls it is."""

    path: str
    repeat: int  # 1 for the first call; ``shared#2`` is the second


def _calls(unit: str) -> list[_Call]:
    """The module calls a unit's name lists (``a+b``, ``shared#2``); slash names of older
    profiles read as dots."""
    calls = []
    for label in unit.replace("/", ".").split("+"):
        path, _, repeat = label.partition("#")
        calls.append(_Call(path, int(repeat) if repeat.isdigit() else 1))
    return calls


def _units(plan: Plan) -> list[list[str]]:
    """Each stage's unit names, in stage order (stage s on rank ``s % K``)."""
    return [[name.replace("/", ".") for name in stage.layers] for stage in plan.stages]


def _paths(plan: Plan) -> list[list[list[str]]]:
    """Per stage, per unit, the modules the unit calls."""
    return [[[call.path for call in _calls(unit)] for unit in units] for units in _units(plan)]


def _ranks(plan: Plan) -> int:
    return plan.num_stages // plan.virtual_stages


def _refuse(fmt: str, why: str) -> ValueError:
    return ValueError(f"cannot export the plan as {fmt}: {why}")


def _check_modules(plan: Plan, fmt: str) -> None:
    """Every unit is module calls, and each module's calls lie in one stage."""
    where: dict[str, tuple[int, str]] = {}
    for k, units in enumerate(_units(plan)):
        for unit in units:
            for call in _calls(unit):
                if call.path == _OWN_CODE or not _PATH.fullmatch(call.path):
                    raise _refuse(
                        fmt,
                        f"unit {unit!r} of stage {k} is no module call (the model's own code "
                        "or a function), and the runtime splits a model between modules",
                    )
                first = where.setdefault(call.path, (k, unit))
                if first[0] != k:
                    raise _refuse(
                        fmt,
                        f"module {call.path!r} is called in stage {first[0]} (unit "
                        f"{first[1]!r}) and in stage {k} (unit {unit!r}); a module runs in "
                        "one stage: plan with its calls in one stage",
                    )


def _dumps(data: dict[str, object]) -> str:
    """JSON with one key a line and each list of names on one line, to read and diff."""

    def value(item: object) -> str:
        if isinstance(item, list) and item and all(isinstance(x, list) for x in item):
            return "[\n" + ",\n".join(f"    {json.dumps(x)}" for x in item) + "\n  ]"
        return json.dumps(item)

    body = ",\n".join(f"  {json.dumps(key)}: {value(item)}" for key, item in data.items())
    return "{\n" + body + "\n}\n"


def _header(plan: Plan, comment: str) -> str:
    ranks, v = _ranks(plan), plan.virtual_stages
    placed = f", {v} per rank: rank r runs stages r, r+{ranks}, ..." if v > 1 else ""
    if plan.schedule in _V_SCHEDULES:
        placed = f", 2 per rank in a V: rank r runs stages r and {2 * ranks - 1}-r"
    return (
        f"{comment} autopipe plan: {plan.num_stages} stages on {ranks} ranks{placed}; "
        f"balance {plan.balance}, {plan.chunks} micro-batch{'es' if plan.chunks > 1 else ''}, "
        f"schedule {plan.schedule}"
    )


def _split_points(plan: Plan, fmt: str) -> list[str]:
    """The modules where stages 1..K-1 begin."""
    _check_modules(plan, fmt)
    points = []
    for k, units in enumerate(_units(plan)[1:], start=1):
        first = _calls(units[0])[0]
        if first.repeat > 1:  # a split point splits before every call of the module
            raise _refuse(
                fmt,
                f"stage {k} begins with unit {units[0]!r}, call {first.repeat} of module "
                f"{first.path!r}; torch splits before a module's every call, so a stage can "
                "begin only at a module's first call",
            )
        points.append(first.path)
    repeated = {c.path for units in _units(plan) for u in units for c in _calls(u) if c.repeat > 1}
    for path in points:
        if path in repeated:  # it would begin a stage at each of its calls
            raise _refuse(
                fmt,
                f"a stage begins at module {path!r}, which is called more than once; torch "
                "splits before its every call: plan with the stage beginning elsewhere",
            )
    return points


def _torch(plan: Plan) -> str:
    points = _split_points(plan, "torch")
    lines = [
        _header(plan, "#"),
        f"# for {_TORCH_CALL}",
        "from torch.distributed.pipelining import SplitPoint",
        "",
        "split_spec = {",
        *(f'    "{path}": SplitPoint.BEGINNING,' for path in points),
        "}",
    ]
    return "\n".join(lines) + "\n"


def _torch_json(plan: Plan) -> str:
    points = _split_points(plan, "torch-json")
    data = {
        "split_spec": {path: "BEGINNING" for path in points},
        "num_stages": plan.num_stages,
        "ranks": _ranks(plan),
        "virtual_stages": plan.virtual_stages,
    }
    return _dumps(data)


def _titan_module(path: str) -> str:
    """The module torchtitan's splitter keeps or drops whole for ``path``: a top-level
    module, or an entry of a top-level ``ModuleList`` / ``ModuleDict`` (``layers.3``)."""
    parts = path.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1].isdigit() else parts[0]


def _titan_parts(plan: Plan, fmt: str) -> list[list[str]]:
    """``module_fqns_per_model_part``: one list of module names per stage, in stage order."""
    _check_modules(plan, fmt)
    owner: dict[str, tuple[int, str]] = {}
    parts: list[list[str]] = []
    for k, units in enumerate(_units(plan)):
        names: list[str] = []
        for unit in units:
            for call in _calls(unit):
                module = _titan_module(call.path)
                first = owner.setdefault(module, (k, unit))
                if first[0] != k:
                    fix = (
                        "plan with whole entries as units (--granularity blocks)"
                        if "." in module
                        else "torchtitan splits a model between its top-level modules"
                    )
                    raise _refuse(
                        fmt,
                        f"the cut between stages {first[0]} and {k} (units {first[1]!r} and "
                        f"{unit!r}) lies inside {module!r}, which torchtitan keeps whole (its "
                        "splitter keeps top-level modules and the entries of a top-level "
                        f"ModuleList or ModuleDict); {fix}",
                    )
                if module not in names:
                    names.append(module)
        parts.append(names)
    return parts


_TORCH_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "zb": "InterleavedZeroBubble"}
# The V schedules: torch and torchtitan place stage i on its V rank themselves, so the parts
# stay in stage order.
_V_SCHEDULES = {"zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}
_LOOPED_SCHEDULES = {"gpipe": "LoopedBFS", "1f1b": "Interleaved1F1B", "zb": "InterleavedZeroBubble"}


def _torch_schedule(plan: Plan) -> str:
    """The name torch's ``get_schedule_class`` knows the plan's schedule by."""
    if plan.schedule in _V_SCHEDULES:
        return _V_SCHEDULES[plan.schedule]
    names = _LOOPED_SCHEDULES if plan.virtual_stages > 1 else _TORCH_SCHEDULES
    return names[plan.schedule]


def _torchtitan(plan: Plan) -> str:
    from autopipe.planning.runtimes.titan_config import titan_toml

    parts = _titan_parts(plan, "torchtitan")
    toml = titan_toml(plan, parts, _torch_schedule(plan), _paths(plan))
    return _header(plan, "#") + "\n" + toml


def _torchtitan_json(plan: Plan) -> str:
    from autopipe.planning.runtimes.titan_config import titan_json

    parts = _titan_parts(plan, "torchtitan-json")
    return _dumps(titan_json(plan, parts, _torch_schedule(plan), _paths(plan)))


def _deepspeed(plan: Plan) -> str:
    if plan.virtual_stages > 1:
        raise _refuse(
            "deepspeed",
            f"DeepSpeed's PipelineModule runs one stage per rank but the plan has "
            f"{plan.virtual_stages} per rank; plan with --virtual-stages 1",
        )
    parts = [0]
    for size in plan.balance:
        parts.append(parts[-1] + size)
    data = {"num_stages": plan.num_stages, "parts": parts, "layers": _units(plan)}
    return _dumps(data)


def _megatron(plan: Plan) -> str:
    from autopipe.planning.runtimes.megatron_layout import megatron_arguments
    from autopipe.planning.runtimes.megatron_mesh import megatron_mesh

    if plan.schedule in _V_SCHEDULES:
        raise _refuse(
            "megatron",
            f"Megatron-LM has no V schedule to run {plan.schedule}; plan with --schedule "
            "1f1b (and --virtual-stages 2 for its interleaved schedule)",
        )
    _check_modules(plan, "megatron")
    stages = _paths(plan)
    try:
        flags, comments = megatron_mesh(plan, stages)
        arguments = megatron_arguments(stages, _ranks(plan), flags)
    except ValueError as exc:
        raise _refuse("megatron", str(exc)) from None
    return "\n".join([_header(plan, "#"), *comments, arguments])


_EXPORTERS: dict[str, Callable[[Plan], str]] = {
    "torch": _torch,
    "torch-json": _torch_json,
    "torchtitan": _torchtitan,
    "torchtitan-json": _torchtitan_json,
    "megatron": _megatron,
    "deepspeed": _deepspeed,
}
EXPORT_FORMATS: tuple[str, ...] = tuple(_EXPORTERS)


def check_export_format(fmt: str) -> str:
    """``fmt`` when it is one of :data:`EXPORT_FORMATS`.

    Raises:
        ValueError: an unknown format, with the known ones.
    """
    if fmt not in _EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; choose {', '.join(EXPORT_FORMATS)}")
    return fmt


def export_plan(plan: Plan, fmt: str) -> str:
    """The plan's split as ``fmt`` takes it (see :meth:`Plan.export`).

    Raises:
        ValueError: an unknown format, or a split the format cannot express (the message
            names the cut).
    """
    return _EXPORTERS[check_export_format(fmt)](plan)
