"""Grad-mode regions of a model's code (no_grad, enable_grad...), kept through tracing."""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.fx.proxy as fx_proxy
from torch import nn
from torch.autograd import grad_mode

__all__: list[str] = []  # internal to the package

# node.meta[KEY]: the grad mode the model's code set for the node, or None for the caller's.
KEY = "autopipe_grad"
_COMPUTE = ("call_function", "call_method", "call_module")

_local = threading.local()
_lock = threading.Lock()
_installed: list[tuple[type, str, Any]] = []
_users = 0


def _active() -> bool:
    return getattr(_local, "active", False)


def _enter(obj: Any, mode: bool | None) -> None:
    """Records that ``obj`` set the grad mode to ``mode``, to put back on its exit."""
    obj.__dict__.setdefault("_autopipe_prev", []).append(_local.state)
    _local.state = mode


def _exit(obj: Any) -> None:
    stack = obj.__dict__.get("_autopipe_prev")
    if stack:
        _local.state = stack.pop()


def _patches() -> list[tuple[type, str, Any]]:
    """Replacements that follow the grad mode the traced code sets, while tracing only."""
    create_node = fx_proxy.TracerBase.create_node
    no_grad = (grad_mode.no_grad.__enter__, grad_mode.no_grad.__exit__)
    enable = (grad_mode.enable_grad.__enter__, grad_mode.enable_grad.__exit__)
    setter = grad_mode.set_grad_enabled
    set_init, set_enter, set_exit, set_call = (
        setter.__init__,
        setter.__enter__,
        setter.__exit__,
        setter.__call__,
    )
    inference = (grad_mode.inference_mode.__enter__, grad_mode.inference_mode.__exit__)

    def stamp(self: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = create_node(self, *args, **kwargs)
        if _active():
            node.meta[KEY] = _local.state
        return node

    def region(enter: Any, leave: Any, mode: bool) -> tuple[Any, Any]:
        # Each manager changes the mode through set_grad_enabled; its own state wins after.
        def entered(self: Any) -> None:
            prev = getattr(_local, "state", None)
            enter(self)
            if _active():
                _local.state = prev
                _enter(self, mode)

        def left(self: Any, *exc: Any) -> None:
            leave(self, *exc)
            if _active():
                _exit(self)

        return entered, left

    def init(self: Any, mode: bool) -> None:
        set_init(self, mode)
        if _active():
            _enter(self, bool(mode))

    def enter_set(self: Any) -> None:
        set_enter(self)
        if _active():
            _local.state = bool(self.mode)

    def exit_set(self: Any, *exc: Any) -> None:
        set_exit(self, *exc)
        if _active():
            _exit(self)

    def call_set(self: Any, function: Any) -> Any:
        if _active():
            _exit(self)  # as a decorator it restores the mode at once
        return set_call(self, function)

    def enter_inference(self: Any) -> None:
        if not _active():
            return inference[0](self)
        # Traced as no_grad: the same values and gradients, without inference tensors,
        # which could not be sent between stages or saved for re-computation.
        self._autopipe_grad = torch.is_grad_enabled()
        if self.mode:
            torch._C._set_grad_enabled(False)
            _enter(self, False)
        return None

    def exit_inference(self: Any, *exc: Any) -> None:
        if "_autopipe_grad" not in self.__dict__:
            return inference[1](self, *exc)
        torch._C._set_grad_enabled(self.__dict__.pop("_autopipe_grad"))
        if self.mode:
            _exit(self)
        return None

    return [
        (fx_proxy.TracerBase, "create_node", stamp),
        (grad_mode.no_grad, "__enter__", region(*no_grad, False)[0]),
        (grad_mode.no_grad, "__exit__", region(*no_grad, False)[1]),
        (grad_mode.enable_grad, "__enter__", region(*enable, True)[0]),
        (grad_mode.enable_grad, "__exit__", region(*enable, True)[1]),
        (setter, "__init__", init),
        (setter, "__enter__", enter_set),
        (setter, "__exit__", exit_set),
        (setter, "__call__", call_set),
        (grad_mode.inference_mode, "__enter__", enter_inference),
        (grad_mode.inference_mode, "__exit__", exit_inference),
    ]


@contextlib.contextmanager
def tracking() -> Iterator[None]:
    """Stamps each node traced in this thread with the grad mode the model's code set.

    ``node.meta[KEY]`` is ``False`` under ``torch.no_grad()``, ``set_grad_enabled(False)``
    or ``torch.inference_mode()`` (kept as no_grad: the same values and gradients),
    ``True`` under ``torch.enable_grad()`` or ``set_grad_enabled(True)``, and ``None``
    elsewhere: the caller's mode. Other threads see the managers unchanged.
    """
    global _users
    with _lock:
        if _users == 0:
            for owner, name, replacement in _patches():
                _installed.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, replacement)
        _users += 1
    saved = getattr(_local, "active", False), getattr(_local, "state", None)
    _local.active, _local.state = True, None
    try:
        yield
    finally:
        _local.active, _local.state = saved
        with _lock:
            _users -= 1
            if _users == 0:
                while _installed:
                    owner, name, original = _installed.pop()
                    setattr(owner, name, original)


def grad_mode_of(node: fx.Node) -> bool | None:
    """The grad mode the model's code set for ``node``, ``None`` for the caller's."""
    mode = node.meta.get(KEY)
    return mode if isinstance(mode, bool) else None


def inline_grad_regions(root: nn.Module, graph: fx.Graph) -> None:
    """Replaces export's ``wrap_with_set_grad_enabled`` calls by their nodes, stamped.

    Export puts each region whose grad mode differs from the tracing one in a submodule;
    inlined, the region's module calls can be cut between like any others.

    Raises:
        ValueError: a region's result is used otherwise than by indexing it.
    """
    hop = torch.ops.higher_order.wrap_with_set_grad_enabled
    while regions := graph.find_nodes(op="call_function", target=hop):
        for node in regions:  # nested regions are inlined on the next round
            _inline(root, graph, node)


def _inline(root: nn.Module, graph: fx.Graph, node: fx.Node) -> None:
    mode, holder, *operands = node.args
    assert isinstance(holder, fx.Node) and holder.op == "get_attr"
    body = root.get_submodule(str(holder.target))
    assert isinstance(body, fx.GraphModule)
    env: dict[fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), operands))
    results: tuple[Any, ...] = ()
    with graph.inserting_before(node):
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                results = tuple(fx.node.map_arg(inner.args[0], env.__getitem__))
                continue
            copy = graph.node_copy(inner, env.__getitem__)
            if inner.op == "get_attr":  # a nested region's body, under this one's
                copy.target = f"{holder.target}.{inner.target}"
            else:
                copy.meta[KEY] = bool(mode)
            env[inner] = copy
    for user in list(node.users):
        if user.target is not operator.getitem:
            raise ValueError(
                f"cannot inline the grad-mode region {node.name}: {user.name} uses its result"
            )
        user.replace_all_uses_with(results[user.args[1]])  # type: ignore[index]
        graph.erase_node(user)
    graph.erase_node(node)
    if not holder.users:
        graph.erase_node(holder)


def insert_grad_modes(graph: fx.Graph) -> None:
    """Makes the graph set the grad mode its nodes were traced in, and restore the caller's.

    A region cut between units is entered again in each unit that holds part of it. Graphs
    without regions are left unchanged.
    """
    nodes = [n for n in graph.nodes if n.op in _COMPUTE]
    if all(grad_mode_of(n) is None for n in nodes):
        return
    placeholders = graph.find_nodes(op="placeholder")
    with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before():
        outer = graph.call_function(torch.is_grad_enabled)
    current: bool | None = None
    for node in nodes:
        mode = grad_mode_of(node)
        if mode != current:
            with graph.inserting_before(node):
                graph.call_function(torch._C._set_grad_enabled, (outer if mode is None else mode,))
            current = mode
    if current is not None:
        (output,) = graph.find_nodes(op="output")
        with graph.inserting_before(output):
            graph.call_function(torch._C._set_grad_enabled, (outer,))
