"""A stage's backward split in two (zero-bubble pipelines, Qi et al. 2024, §2): ``B`` computes
the gradients of the stage's *inputs* now (the previous stage waits for them), ``W`` those of
its *weights* later.

The autograd graph from a part's outputs ``y`` (incoming gradients ``g``) down to its inputs
``x`` (detached leaves) and weights ``w`` (every other leaf that requires grad) is split at
the *junctions*: nodes ``J`` on a path to some input whose next edge ``e`` leads only to
weights (``AddmmBackward`` of ``x @ w.T + b``). ``B`` (:func:`backward_inputs`) is
``autograd.grad(y, x, g)`` with a pre-hook on each junction keeping ``dL/dJ``: the engine runs
only the edges toward ``x``. ``W`` (:meth:`Deferred.run`) sends each junction's ``dL/dJ``
along its weight-side edges (each junction apart, so none is fed twice), then one
``autograd.grad`` from those edges to the weights. Every weight gradient is the sum of the
same node-local products as in one ``backward()`` (the chain rule cut at ``J``), so ``B``
then ``W`` equals the full backward up to float summation order; torch's
``stage_backward_input``/``stage_backward_weight`` split the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Edge = tuple[Node, int]


def _is_leaf_node(node: Node) -> bool:
    """An ``AccumulateGrad`` node: it ends at a leaf tensor (``.variable``)."""
    return hasattr(node, "variable")


def _variable(node: Node) -> torch.Tensor:
    return node.variable  # type: ignore[attr-defined,no-any-return]


@dataclass
class Deferred:
    """What ``B`` left for ``W``: each junction's incoming gradients and weight-side edges,
    and the outputs whose gradients reach weights only."""

    junctions: list[tuple[Node, list[torch.Tensor | None], list[Edge]]] = field(default_factory=list)
    direct: list[tuple[Edge, torch.Tensor]] = field(default_factory=list)

    def run(self) -> None:
        """The weight pass: weight gradients accumulated into each leaf's ``.grad``."""
        at: dict[Edge, torch.Tensor] = {}
        fresh: set[Any] = set()  # edges (and leaves) whose gradient was made here: no one else holds it
        for (node, nr), g in self.direct:
            _add(at, (node, nr), g)
        for node, incoming, edges in self.junctions:
            outs = [GradientEdge(node, k) for k, g in enumerate(incoming) if g is not None]
            if not outs:
                continue
            fast = _linear_side(node, incoming, edges)
            if fast is not None:  # a Linear's weight and bias gradients, without an engine call
                for e, g in zip(edges, fast, strict=True):
                    leaf = _transposed_leaf(e)
                    if leaf is not None:  # w.t()'s gradient, transposed back: w's own, contiguous
                        _add(at, leaf, g.t())
                        fresh.add(leaf)
                    else:
                        _add(at, e, g, fresh)
                continue
            got = torch.autograd.grad(outs, [GradientEdge(n, nr) for n, nr in edges],
                                      grad_outputs=[g for g in incoming if g is not None],
                                      retain_graph=True, allow_unused=True)
            for e, g in zip(edges, got, strict=True):
                if g is not None:
                    _add(at, e, g)
        self.junctions.clear()
        roots: list[GradientEdge] = []
        grads: list[torch.Tensor] = []
        leaves: dict[Node, torch.Tensor] = {}
        # each weight's gradient of this pass, summed first and then added to its .grad
        # once, as AccumulateGrad adds its summed input (so accumulating over micro-batches
        # rounds as backward() does)
        total: dict[Node, torch.Tensor] = {}
        for (node, nr), g in at.items():
            if _is_leaf_node(node):  # the edge ends at the weight itself
                _add(total, node, g, fresh)
                if (node, nr) in fresh:
                    fresh.add(node)
                continue
            roots.append(GradientEdge(node, nr))
            grads.append(g)
            _weights_below(node, leaves)
        if roots and leaves:
            got = torch.autograd.grad(roots, list(leaves.values()), grad_outputs=grads, allow_unused=True)
            for node, g in zip(leaves, got, strict=True):
                if g is not None:
                    _add(total, node, g, fresh)
                    if _once(g, got):
                        fresh.add(node)
        for node, g in total.items():
            _accumulate(_variable(node), g, owned=node in fresh, inplace=True)


def _linear_side(node: Node, incoming: Sequence[torch.Tensor | None],
                 edges: Sequence[Edge]) -> list[torch.Tensor] | None:
    """What ``AddmmBackward0`` of ``F.linear(x, w, b)`` sends along its weight-side edges, by
    autograd's own formulas (``mm_mat2_backward``, the bias's ``sum_to``), so the W pass needs
    no engine call per Linear (each walks the whole graph below it). None (the generic path)
    for any other node or case (``alpha``/``beta`` not 1, a bias edge not the leaf itself)."""
    if type(node).__name__ != "AddmmBackward0" or len(incoming) != 1 or incoming[0] is None:
        return None
    n: Any = node
    if n._saved_alpha != 1 or n._saved_beta != 1:
        return None
    nexts = list(node.next_functions)
    where = [nexts.index(e) if nexts.count(e) == 1 else -1 for e in edges]
    if any(k not in (0, 2) for k in where):
        return None
    g = incoming[0]
    out: list[torch.Tensor] = []
    for e, k in zip(edges, where, strict=True):
        if k == 2:  # mat2 = w.t(): d/dmat2 = mat1^T g, column-major when mat2 was
            mat1 = n._saved_mat1
            sizes, strides = n._saved_mat2_sym_sizes, n._saved_mat2_sym_strides
            if strides[0] == 1 and strides[1] == sizes[0]:
                out.append(g.t().mm(mat1).t())
            else:
                out.append(mat1.t().mm(g))
        else:  # self = the bias, broadcast over rows: summed back to its shape
            if not _is_leaf_node(e[0]):
                return None
            shape = _variable(e[0]).shape
            out.append(g if tuple(g.shape) == tuple(shape) else g.sum_to_size(shape))
    return out


def _transposed_leaf(e: Edge) -> Edge | None:
    """The weight's own edge where ``e`` is ``w.t()``'s (``TBackward0`` straight onto a
    leaf, as ``F.linear`` reads a weight), else None."""
    node = e[0]
    if type(node).__name__ != "TBackward0":
        return None
    nexts = [(n, nr) for n, nr in node.next_functions if n is not None]
    if len(nexts) != 1 or not _is_leaf_node(nexts[0][0]):
        return None
    return nexts[0]


def _add(at: dict[Any, torch.Tensor], e: Any, g: torch.Tensor, fresh: set[Any] | None = None) -> None:
    """``at[e] += g`` out of place (a sum is a new tensor: ``fresh`` gets ``e``)."""
    if e in at:
        at[e] = at[e] + g
        if fresh is not None:
            fresh.add(e)
    else:
        at[e] = g


def _accumulate(w: torch.Tensor, g: torch.Tensor, *, owned: bool = False, inplace: bool = False) -> None:
    """``w.grad += g`` as ``AccumulateGrad`` does: a first gradient kept when ``owned`` (no
    other leaf got the same tensor: autograd hands ``a + b``'s to both), else copied;
    ``inplace``: added into the existing ``.grad`` (a fresh weight-sized buffer per
    micro-batch costs an allocation and its pages' first touch every W pass)."""
    if w.grad is not None:
        if inplace and w.grad.dtype == g.dtype and w.grad.stride() == g.stride() and not w.grad.requires_grad:
            with torch.no_grad():
                w.grad.add_(g.reshape(w.grad.shape))
        else:
            w.grad = w.grad + g
    elif owned and g.dtype == w.dtype and g.stride() == w.stride():
        w.grad = g.detach()
    else:
        w.grad = g.to(w.dtype, copy=True).reshape(w.shape)


def _once(g: torch.Tensor, got: Sequence[torch.Tensor | None]) -> bool:
    """``g`` shares its storage with no other result of the same call."""
    ptr = g.untyped_storage().data_ptr()
    return sum(1 for h in got if h is not None and h.untyped_storage().data_ptr() == ptr) == 1


def _weights_below(node: Node, out: dict[Node, torch.Tensor]) -> None:
    stack, seen = [node], {node}
    while stack:
        n = stack.pop()
        if _is_leaf_node(n):
            out[n] = _variable(n)
            continue
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)


def _reach(roots: Sequence[Node], inputs: set[Node]) -> tuple[dict[Node, bool], dict[Node, bool]]:
    """For every node below ``roots``: does it lead to an input, to a weight?"""
    to_input: dict[Node, bool] = {}
    to_weight: dict[Node, bool] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    seen: set[Node] = set()
    while stack:  # iterative post-order: children before parents
        n, expanded = stack.pop()
        if expanded:
            order.append(n)
            continue
        if n in seen:
            continue
        seen.add(n)
        stack.append((n, True))
        stack.extend((c, False) for c, _ in n.next_functions if c is not None and c not in seen)
    for n in order:
        if _is_leaf_node(n):
            to_input[n] = n in inputs
            to_weight[n] = n not in inputs
            continue
        kids = [c for c, _ in n.next_functions if c is not None]
        to_input[n] = any(to_input.get(c, False) for c in kids)
        to_weight[n] = any(to_weight.get(c, False) for c in kids)
    return to_input, to_weight


def backward_inputs(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor]) -> Deferred:
    """``B``: accumulate ``d(sum_k <outputs_k, grads_k>)/d(inputs)`` into each input's
    ``.grad`` (a ``None`` grad: ones, for a scalar loss) and return the weight pass."""
    gs = [torch.ones_like(t) if g is None else g for t, g in zip(outputs, grads, strict=True)]
    edges = [get_gradient_edge(t) for t in outputs]
    input_nodes = {get_gradient_edge(x).node for x in inputs}
    to_input, to_weight = _reach([e.node for e in edges], input_nodes)
    deferred = Deferred()
    for e, g in zip(edges, gs, strict=True):
        if not to_input[e.node] and to_weight[e.node]:
            deferred.direct.append(((e.node, e.output_nr), g))
    handles: list[Any] = []
    for n, reaches in to_input.items():
        if not reaches or _is_leaf_node(n):
            continue
        side = [(c, nr) for c, nr in n.next_functions
                if c is not None and not to_input[c] and to_weight[c]]
        if side:
            slot: list[torch.Tensor | None] = []
            deferred.junctions.append((n, slot, side))
            handles.append(n.register_prehook(
                lambda grad_outputs, slot=slot: slot.extend(grad_outputs)))  # type: ignore[misc]
    wanted = [x for x in inputs if to_input.get(get_gradient_edge(x).node, False)]
    try:
        if wanted:
            got = torch.autograd.grad(list(outputs), wanted, grad_outputs=gs, retain_graph=True,
                                      allow_unused=True)
            for x, g in zip(wanted, got, strict=True):
                if g is not None:
                    _accumulate(x, g, owned=_once(g, got))
    finally:
        for h in handles:
            h.remove()
    return deferred
