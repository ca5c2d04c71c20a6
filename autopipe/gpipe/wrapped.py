"""``WrappedPipeline``: a traced model run by GPipe, called and named like the original."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from autopipe.gpipe.gpipe import refuse_device_move
from autopipe.graph import PREFIX, UnitModule

if TYPE_CHECKING:
    from autopipe.gpipe.gpipe import GPipe
    from autopipe.graph import ModelIO
    from autopipe.planning import Plan

__all__ = ["WrappedPipeline"]


def _moving_denied() -> TypeError:
    return TypeError(
        "a wrapped model is spread over its stages' devices; it cannot be moved to one "
        "device (dtype conversions with .to(dtype) are allowed)"
    )


class WrappedPipeline(nn.Module):
    """A model split into pipeline stages by :func:`autopipe.wrap`.

    Called like the original model, it returns the same structure of outputs. The
    original model's children, parameters and buffers are registered under their own
    names (they are the same objects, moved to their stages' devices), so
    ``state_dict()`` has the original keys and checkpoints load both ways.

    Attributes:
        plan: the plan the stages follow.
        pipeline: the :class:`~autopipe.gpipe.GPipe` running the units.
        units: the unit names, in pipeline order.
        method: how the model was traced: ``fx`` or ``export``.
    """

    def __init__(
        self,
        model: nn.Module,
        pipeline: GPipe,
        plan: Plan,
        io: ModelIO,
    ) -> None:
        super().__init__()
        reserved = set(dir(type(self))) | {"method"}
        names = [n for n, _ in model.named_children()]
        names += [n for n, _ in model.named_parameters(recurse=False)]
        names += [n for n, _ in model.named_buffers(recurse=False)]
        for name in names:
            if name in reserved:
                raise ValueError(
                    f"the model's attribute {name!r} clashes with a WrappedPipeline name"
                )
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buffer in model.named_buffers(recurse=False):
            persistent = name not in model._non_persistent_buffers_set
            self.register_buffer(name, buffer, persistent=persistent)
        self.training = model.training
        # The pipeline's own modules (GPipe, partitions, units) start in the model's mode;
        # the model's modules keep theirs, which may be mixed.
        originals = {id(m) for m in model.modules()}
        for module in [*pipeline.modules(), *pipeline.partitions]:
            if id(module) not in originals:
                module.training = model.training
        state = self.__dict__
        state["_autopipe_model"] = model
        state["_autopipe_pipeline"] = pipeline
        state["_autopipe_plan"] = plan
        state["_autopipe_io"] = io
        state["method"] = io.method
        self._sync_buffers()

    @property
    def plan(self) -> Plan:
        plan: Plan = self.__dict__["_autopipe_plan"]
        return plan

    @property
    def pipeline(self) -> GPipe:
        pipeline: GPipe = self.__dict__["_autopipe_pipeline"]
        return pipeline

    @property
    def replicated(self) -> dict[str, tuple[int, ...]]:
        """The model's tensors that several stages hold (a tied embedding and LM head), by
        their first name in the model: the stages holding a copy, the owner first."""
        model: nn.Module = self.__dict__["_autopipe_model"]
        names: dict[int, str] = {}
        named: list[tuple[str, Tensor]] = [*model.named_parameters(remove_duplicate=False)]
        named += model.named_buffers(remove_duplicate=False)
        for name, tensor in named:
            names.setdefault(id(tensor), name)
        held = self.pipeline.__dict__["_replicas"].held()
        return {names.get(id(t), "<unnamed>"): stages for t, stages in held}

    @property
    def units(self) -> list[str]:
        return [unit.name for unit in self.pipeline if isinstance(unit, UnitModule)]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the model's inputs through the pipeline.

        Tensor inputs must have the batch along dim 0; non-tensor inputs must equal the
        values the model was traced with. A model traced by torch.export also needs the
        traced dtypes and, besides the batch and the dims passed as ``dynamic=``, the
        traced sizes.

        Raises:
            ValueError: the inputs differ from the traced ones where the graph fixed them.
        """
        io: ModelIO = self.__dict__["_autopipe_io"]
        tensors = io.flatten(args, kwargs)
        io.check(tensors, self.training)
        output = self.pipeline(tensors[0] if len(tensors) == 1 else tensors)
        return io.rebuild(output, self.training)

    def train(self, mode: bool = True) -> WrappedPipeline:
        super().train(mode)
        self.pipeline.train(mode)
        return self

    def close(self) -> None:
        """Stops the pipeline's worker threads."""
        self.pipeline.close()

    def _sync_buffers(self) -> None:
        """Points the model's buffers at the tensors the units hold.

        A unit reads a buffer through a copy of its attribute path; moving the unit to a
        device (or dtype) replaces the tensor there only.
        """
        model: nn.Module = self.__dict__["_autopipe_model"]
        for unit in self.pipeline:
            if not isinstance(unit, UnitModule):
                continue
            for graph in unit.graphs.values():
                for node in graph.graph.find_nodes(op="get_attr"):
                    target = str(node.target)
                    if not target.startswith(PREFIX + "."):
                        continue
                    path, _, name = target[len(PREFIX) + 1 :].rpartition(".")
                    try:
                        owner = model.get_submodule(path)
                        holder = graph.get_submodule(f"{PREFIX}.{path}" if path else PREFIX)
                    except AttributeError:
                        continue
                    if name in owner._buffers and name in holder._buffers:
                        owner._buffers[name] = holder._buffers[name]
                        if not path:
                            self._buffers[name] = holder._buffers[name]

    def cuda(self, device: Any = None) -> WrappedPipeline:
        raise _moving_denied()

    def cpu(self) -> WrappedPipeline:
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> WrappedPipeline:
        refuse_device_move(args, kwargs, _moving_denied)
        self.pipeline.to(*args, **kwargs)
        super().to(*args, **kwargs)
        self._sync_buffers()
        return self
