"""Trace any ``nn.Module`` into a torch.fx graph whose module nodes keep their names.

torch's own layers stay single ``call_module`` nodes; a user module is traced into, so its
children appear by their ``named_modules()`` names. A module is kept whole (a *leaf*) when its
path is in ``leaves`` (``model.leaf_modules``) or its class is decorated with :func:`leaf`.

When fx fails and an example input is given, the model is captured with ``torch.export``
(non-strict; docs/model-parallel.md): ATen operations, each with ``meta["nn_module_stack"]``,
so a claim on ``model.layers.1`` places exactly that layer's operations (as torch's
``pipeline(split_spec=)`` cuts an exported graph). :func:`export_graph` makes ``ep.module()``
ready to cut: dimension 0 of every input dynamic; a flat codegen whose placeholders are the
leaves of ``(args, kwargs)``, the pytree specs kept in ``gm.meta`` (``IN_SPEC``, ``OUT_SPEC``);
export's guards and shape assertions dropped; each ``SymInt`` copied per reader (sizes never
travel); ``use_cache`` off; each training-mode dropout a small module following its part's
mode. :func:`canonical_ties` names a tied tensor by its first name, so a tie is one value.

Export has no leaves: a leaf's forward may be what export cannot trace, and a tensor-parallel
layer runs collectives (which fake tensors cannot) inside autograd Functions (whose backward
export would drop). So while exporting, each leaf's ``forward`` is one call of the opaque
custom op ``paratrain::leaf(xs, key)`` (:func:`kept_whole`), whose fake implementation is the
leaf's ``meta_forward`` (a shape function: the TP layers) or its own forward;
:func:`as_call_modules` then makes each such node a ``call_module`` of the leaf itself.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from ..config import ConfigError
from .sizes import tensor_at

LEAF_ATTR = "__paratrain_leaf__"
_M = TypeVar("_M", bound=type)


def leaf(cls: _M) -> _M:
    """Class decorator: trace instances of ``cls`` as one node (never into its forward)."""
    setattr(cls, LEAF_ATTR, True)
    return cls


class _Tracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaves or getattr(type(m), LEAF_ATTR, False):
            return True
        return bool(super().is_leaf_module(m, module_qualified_name))

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module: the first to see the error
                try:
                    self.failed_in = self.path_of_module(m)
                except NameError:
                    self.failed_in = type(m).__name__
            raise


def trace(model: nn.Module, leaves: Iterable[str] = (),
          example: tuple[tuple[Any, ...], dict[str, Any]] | None = None) -> fx.GraphModule:
    """``model`` as a GraphModule sharing its parameters (see module docstring); a tied
    tensor read by ``get_attr`` under its first name (:func:`.export.canonical_ties`)."""
    wanted = set(leaves)
    known = dict(model.named_modules())
    bad = sorted(p for p in wanted if p not in known or not p)
    if bad:
        names = [n for n in known if n]
        raise ConfigError([("model.leaf_modules", f"{', '.join(map(repr, bad))} is not a module "
                            f"of this model; its modules are: {', '.join(names[:40])}"
                            + (" ..." if len(names) > 40 else ""))])
    tracer = _Tracer(wanted)
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 - any tracing failure becomes one clear error
        also = ""
        if example is not None:
            try:
                gm = export_graph(model, *example, leaves=_outermost(model, wanted))
            except Exception as e2:  # noqa: BLE001 - reported with fx's error below
                why = (str(e2).strip().splitlines() or [type(e2).__name__])[0]
                also = f"; torch.export (non-strict) failed too: {why}"
            else:
                canonical_ties(gm, model)
                return gm
        where = tracer.failed_in
        what = f"module {where!r} ({type(known[where]).__name__})" if where in known else (
            f"the model's own forward ({type(model).__name__})")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        how = (f"model.leaf_modules = [{where!r}] in the job file, or decorate its class with "
               f"@paratrain.graph.leaf" if where in known and where else
               "a leaf: move the untraceable part into a submodule and list it in "
               "model.leaf_modules")
        raise ConfigError([("model", f"torch.fx cannot trace {what}: {first}{also}. Mark it a "
                            f"leaf (traced as one node, run as-is): {how}")]) from None
    gm = fx.GraphModule(model, graph, type(model).__name__)
    canonical_ties(gm, model)
    return gm


def _outermost(model: nn.Module, wanted: set[str]) -> list[str]:
    """The leaves (listed or of a ``@leaf`` class) not inside another leaf, in model order."""
    out: list[str] = []
    for name, m in model.named_modules():
        if name and (name in wanted or getattr(type(m), LEAF_ATTR, False)) and not any(
                name.startswith(o + ".") for o in out):
            out.append(name)
    return out


_ACTIVE: dict[int, tuple[str, nn.Module, Any]] = {}  # key -> (path, module, its own forward)


@torch.library.custom_op("paratrain::leaf", mutates_args=())
def _leaf(xs: list[torch.Tensor], key: int) -> torch.Tensor:
    """Never run: every node calling it becomes a ``call_module`` (:func:`as_call_modules`)."""
    raise RuntimeError("paratrain::leaf only stands for a leaf module while torch.export traces")


@_leaf.register_fake
def _leaf_fake(xs: list[torch.Tensor], key: int) -> torch.Tensor:
    path, module, forward = _ACTIVE[key]
    meta = getattr(module, "meta_forward", None)
    out = meta(*xs) if callable(meta) else forward(*xs)
    if not isinstance(out, torch.Tensor):
        raise ConfigError([("model.leaf_modules", (
            f"{path!r} ({type(module).__name__}) returns {type(out).__name__}; a module kept whole "
            "in a graph captured by torch.export must return one tensor"))])
    # a fresh tensor: the op's output may not alias its inputs
    return out.clone() if any(out is x for x in xs) else out


def _stand_in(key: int, path: str, module: nn.Module) -> Any:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            got = ", ".join([type(a).__name__ for a in args] + [f"{k}=" for k in kwargs])
            raise ConfigError([("model.leaf_modules", (
                f"{path!r} ({type(module).__name__}) is called with ({got}); a module kept whole in "
                "a graph captured by torch.export takes tensors as positional arguments only"))])
        out: torch.Tensor = torch.ops.paratrain.leaf.default(list(args), key)
        return out

    return forward


@contextlib.contextmanager
def kept_whole(model: nn.Module, leaves: Sequence[str]) -> Iterator[None]:
    """While inside, each module of ``model`` at a path in ``leaves`` traces as one
    ``paratrain::leaf`` node (module docstring)."""
    _ACTIVE.clear()
    for key, path in enumerate(leaves):
        m = model.get_submodule(path)
        _ACTIVE[key] = (path, m, m.forward)
        m.forward = _stand_in(key, path, m)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for _path, m, _ in _ACTIVE.values():
            if "forward" in vars(m):
                del m.forward
        # _ACTIVE stays filled until as_call_modules has read the paths


def as_call_modules(gm: fx.GraphModule, model: nn.Module) -> None:
    """Every ``paratrain::leaf`` node of ``gm`` (captured inside :func:`kept_whole`) as a
    ``call_module`` of the leaf itself, attached to ``gm`` at its path."""
    op = torch.ops.paratrain.leaf.default
    try:
        for n in list(gm.graph.nodes):
            if n.op != "call_function" or n.target is not op:
                continue
            path = _ACTIVE[int(n.args[1])][0]
            gm.add_submodule(path, model.get_submodule(path))
            with gm.graph.inserting_before(n):
                new = gm.graph.call_module(path, tuple(n.args[0]))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
    finally:
        _ACTIVE.clear()


IN_SPEC, OUT_SPEC, CAPTURE = "paratrain_in_spec", "paratrain_out_spec", "paratrain_capture"

_ASSERTS = {
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}


def _dynamic_shapes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``Dim.AUTO`` on dimension 0 of every tensor input, keyed as export wants it (by the
    forward's parameter names; a ``**kwargs`` parameter gets the dict of its entries)."""
    from torch.export import Dim

    def spec(v: Any) -> Any:
        return pytree.tree_map(
            lambda t: {0: Dim.AUTO} if isinstance(t, torch.Tensor) and t.dim() > 0 else None, v)

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: spec(v) for name, v in bound.arguments.items()}


def export_graph(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 leaves: Sequence[str] = ()) -> fx.GraphModule:
    """``model`` captured by ``torch.export`` on the example ``(args, kwargs)`` (see the
    module docstring), the modules at ``leaves`` kept whole as ``call_module`` nodes
    (:func:`kept_whole`). Raises whatever export raises."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False  # type: ignore[union-attr]
    with _quiet(), kept_whole(model, leaves):
        ep = torch.export.export(model, tuple(args), dict(kwargs), strict=False,
                                 dynamic_shapes=_dynamic_shapes(model, tuple(args), dict(kwargs)))
    gm = ep.module()
    assert isinstance(gm, fx.GraphModule)
    as_call_modules(gm, model)
    info = gm.graph._codegen.pytree_info if hasattr(gm.graph._codegen, "pytree_info") else None
    for n in list(gm.graph.nodes):
        if (n.op == "call_module" and str(n.target).startswith("_guards")) or (
                n.op == "call_function" and n.target in _ASSERTS):
            gm.graph.erase_node(n)
    for name, _ in list(gm.named_children()):
        if name.startswith("_guards"):
            delattr(gm, name)
    gm.graph._codegen = fx.graph.CodeGen()
    _copy_sizes_per_reader(gm.graph)
    _dropouts_follow_mode(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gm.meta[CAPTURE] = "export"
    gm.meta[IN_SPEC] = info.in_spec if info is not None else None
    gm.meta[OUT_SPEC] = info.out_spec if info is not None else None
    return gm


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Export's own failure logs and its partial graph (printed to stderr) held back, only
    while it runs (the failure is one ConfigError line, trace.py): its loggers' levels
    raised, then restored."""
    loggers = [logging.getLogger(name) for name in
               ("torch.export", "torch._export", "torch.fx.experimental.symbolic_shapes")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _copy_sizes_per_reader(graph: fx.Graph) -> None:
    """Give every reader of a size value its own copy (latest first, so a copied size's own
    size inputs are copied again for each copy): then each size follows its one reader."""
    for n in reversed(list(graph.nodes)):
        size = isinstance(n.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat | int)
        if n.op != "call_function" or not size or len(n.users) < 2:
            continue
        for user in list(n.users)[1:]:
            with graph.inserting_after(n):
                dup = graph.node_copy(n)
            dup.meta = dict(n.meta)
            user.replace_input_with(n, dup)


class ModeDropout(nn.Module):
    """``aten.dropout(x, p, train)`` (``attention``: ``aten.scaled_dot_product_attention``
    with ``dropout_p = p``) with dropout only in the module's training mode."""

    def __init__(self, p: float, attention: bool = False) -> None:
        super().__init__()
        self.p, self.attention = p, attention

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.attention:
            kwargs["dropout_p"] = self.p if self.training else 0.0
            out: torch.Tensor = torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)
            return out
        return torch.ops.aten.dropout.default(args[0], self.p, self.training)


def _dropouts_follow_mode(gm: fx.GraphModule) -> None:
    """Replace each training-mode dropout by a mode-following module (module docstring)."""
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    for k, n in enumerate(list(gm.graph.nodes)):
        if n.op != "call_function":
            continue
        if n.target is torch.ops.aten.dropout.default and n.args[2] is True and n.args[1] > 0:
            module: nn.Module = ModeDropout(float(n.args[1]))
            args, kwargs = (n.args[0],), {}
        elif n.target is sdpa:
            args, kwargs = n.args[:4], dict(n.kwargs)
            p = n.args[4] if len(n.args) > 4 else kwargs.pop("dropout_p", 0.0)
            kwargs.pop("dropout_p", None)
            kwargs.update(zip(("is_causal", "scale", "enable_gqa"), n.args[5:], strict=False))
            if not p:
                continue
            module = ModeDropout(float(p), attention=True)
        else:
            continue
        where = module_of(n)
        path = f"{where}._mode_op{k}" if where else f"_mode_op{k}"
        gm.add_submodule(path, module)
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(path, tuple(args), kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)


def module_of(node: fx.Node) -> str | None:
    """The qualified name of the module a node runs in: its target for ``call_module``, the
    innermost module whose forward it was traced in otherwise (None at the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] if isinstance(v, tuple) else k for k, v in stack.items()]
    return str(names[-1]) if names else None


def canonical_ties(gm: fx.GraphModule, model: nn.Module) -> None:
    """Rename each ``get_attr`` of a tensor the model holds under several names (a tied
    head) to its first name in ``model.named_parameters()`` / ``named_buffers()``."""
    first: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        first.setdefault(id(t), name)
    changed = False
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        held = tensor_at(gm, str(n.target))
        canon = None if held is None else first.get(id(held))
        if canon is not None and canon != n.target and tensor_at(gm, canon) is held:
            n.target = canon
            changed = True
    if changed:
        gm.recompile()
