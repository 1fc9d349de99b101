"""Blocks written by others that ``parallelize`` shards without a plan (recognised by class
and own ``forward``: :func:`block_kind`; the table is in docs/tensor-parallel.md), and their
layers. HF's forwards run unchanged on the shard (they reshape with ``-1`` heads; the head
counts become the local ones): in grouped-query attention rank ``r`` keeps query heads
``[rH/p, (r+1)H/p)`` and kv heads ``[rK/p, (r+1)K/p)``, exactly those its query heads read,
and only ``eager`` / ``sdpa`` are known to read nothing else. A packed projection (``[q | k |
v]``: GPT-2's ``c_attn``, timm's ``qkv``) is cut part by part (:class:`PackedColumnParallel`),
so rank ``i`` computes ``[q_i | k_i | v_i]``. timm's ``Attention`` reshapes its context to the
input's width, which a shard lacks: :class:`ParallelFusedQKVAttention` runs it on local heads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from paratrain.comm.tp.comm import TPComm
from paratrain.config import ConfigError

from .autograd import copy_to_region, fused_region
from .layers import (
    ColumnParallelLinear,
    RegionState,
    RowParallelLinear,
    _dense_tensors,
    refuse_sequence_shards,
)
from .rules import foreign_tensors, is_elementwise, is_plain_linear, module_where


def is_conv1d(m: nn.Module | None) -> bool:
    """A plain ``transformers.pytorch_utils.Conv1D`` (``forward`` not overridden, only
    ``weight [in, out]`` and ``bias [out]``), without importing transformers."""
    if m is None:
        return False
    for cls in type(m).__mro__:
        if cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils":
            own: bool = type(m).forward is cls.forward  # type: ignore[attr-defined]
            return (own and next(m.children(), None) is None
                    and {n for n, _ in m.named_parameters()} == {"weight", "bias"})
    return False


class ColumnParallelConv1D(ColumnParallelLinear):
    """``Y_i = f(X) W[:, cols_i] + b[cols_i]``: a Conv1D's output columns (weight sharded on dim 1)."""

    conv1d = True


class RowParallelConv1D(RowParallelLinear):
    """``Z = g(sum_i X_i W[rows_i, :]) + b``: a Conv1D's input rows (weight sharded on dim 0)."""

    conv1d = True


class PackedColumnParallel(nn.Module):
    """A projection whose output features are ``n`` equal parts (``[q | k | v]``), column-
    parallel part by part: rank ``i`` computes ``[part_0 cols_i | ... | part_{n-1} cols_i]``.
    ``fused_dim``: where the parts are packed in the dense weight (0 for ``nn.Linear``, 1 for
    Conv1D; the bias on 0), so checkpoints keep the dense name and layout (:mod:`.shards`)."""

    def __init__(self, dense: nn.Module, parts: int, *, comm: TPComm, state: RegionState,
                 unit: int = 1) -> None:
        super().__init__()
        self.conv1d = is_conv1d(dense)
        self.parts = int(parts)
        self.comm = comm
        layer_cls = ColumnParallelConv1D if self.conv1d else ColumnParallelLinear
        w, b = _dense_tensors(dense, self.conv1d)
        n_out, n_in = int(w.shape[0]), int(w.shape[1])
        if n_out % self.parts:
            raise ValueError(f"{n_out} output features do not split into {self.parts} packed parts")
        width = n_out // self.parts
        if width % unit or (width // unit) % comm.size:
            raise ValueError(f"each packed part has {width // unit} heads of {unit}, not divisible by "
                             f"tensor_parallel_size {comm.size}")
        self.in_features, self.out_features = n_in, n_out
        self.fused_dim = 1 if self.conv1d else 0
        self.names = ("q", "k", "v") if self.parts == 3 else tuple(f"p{c}" for c in range(self.parts))
        for c, name in enumerate(self.names):
            cols = slice(c * width, (c + 1) * width)
            layer = layer_cls(n_in, width, comm=comm, state=state, bias=b is not None)
            layer.load_dense(w[cols], b[cols] if b is not None else None)
            self.add_module(name, layer.to(w.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layers = [getattr(self, n) for n in self.names]
        refuse_sequence_shards(layers[0].state, self)
        xs = fused_region(x, self.comm, self.parts)
        return torch.cat([lay(xi, input_done=True) for lay, xi in zip(layers, xs, strict=True)], dim=-1)

    def meta_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output's shape, communicating nothing (see ``ColumnParallelLinear.meta_forward``)."""
        r = self.comm.rank
        return x.new_empty((*x.shape[:-1], sum(getattr(self, n).out_sizes[r] for n in self.names)))

    def extra_repr(self) -> str:
        return f"parts={self.parts}, in={self.in_features}, out={self.out_features}, conv1d={self.conv1d}"


class ParallelFusedQKVAttention(nn.Module):
    """timm's ``Attention`` on ``heads / p`` local heads: ``qkv`` packed-column-parallel,
    ``proj`` row-parallel, the per-head ``q_norm`` / ``k_norm`` and the dropouts kept."""

    def __init__(self, dense: nn.Module, *, comm: TPComm, state: RegionState) -> None:
        super().__init__()
        heads = int(dense.num_heads)  # type: ignore[arg-type]
        if heads % comm.size:
            raise ValueError(f"attention has {heads} heads, not divisible by tensor_parallel_size {comm.size}")
        self.comm = comm
        self.local_heads = heads // comm.size
        self.head_dim = int(dense.head_dim)  # type: ignore[arg-type]
        self.scale = float(dense.scale)  # type: ignore[arg-type]
        self.fused_attn = bool(getattr(dense, "fused_attn", True))
        self.qkv = PackedColumnParallel(dense.qkv, 3, comm=comm, state=state, unit=self.head_dim)  # type: ignore[arg-type]
        self.q_norm: nn.Module = dense.q_norm  # type: ignore[assignment]
        self.k_norm: nn.Module = dense.k_norm  # type: ignore[assignment]
        self.attn_drop: nn.Module = dense.attn_drop  # type: ignore[assignment]
        self.norm: nn.Module = getattr(dense, "norm", nn.Identity())
        self.proj = RowParallelLinear.from_dense(dense.proj, comm=comm, state=state)  # type: ignore[arg-type]
        self.proj_drop: nn.Module = dense.proj_drop  # type: ignore[assignment]

    def _per_head(self, norm: nn.Module, t: torch.Tensor) -> torch.Tensor:
        """``norm`` (replicated) on this rank's heads; its parameters enter through Megatron's f,
        since each rank's heads give only part of their gradient."""
        params = dict(norm.named_parameters())
        if not params or self.comm.size == 1:
            return norm(t)
        return functional_call(norm, {n: copy_to_region(p, self.comm) for n, p in params.items()}, (t,))

    def _local_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """``attn_mask`` for this rank's heads: a mask with a dimension per head ``(B, H, N,
        N)`` is cut to them; one that broadcasts over heads stays whole."""
        if mask is None or mask.dim() < 3 or mask.size(-3) == 1:
            return mask
        heads = self.local_heads * self.comm.size
        if mask.size(-3) != heads:
            raise ValueError(f"attn_mask has {mask.size(-3)} heads in dimension -3; the attention "
                             f"has {heads} (or 1 to broadcast)")
        first = self.comm.rank * self.local_heads
        return mask.narrow(-3, first, self.local_heads)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        """timm's call: ``attn(x, attn_mask=..., is_causal=...)`` (SDPA's meaning of both:
        a boolean mask keeps where True, a float mask is added to the scores)."""
        b, n, _ = x.shape
        mask = self._local_mask(attn_mask)
        qkv = self.qkv(x).reshape(b, n, 3, self.local_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self._per_head(self.q_norm, q), self._per_head(self.k_norm, k)
        if self.fused_attn:
            p = float(getattr(self.attn_drop, "p", 0.0)) if self.training else 0.0
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            if is_causal:
                attn = attn.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1),
                                        float("-inf"))
            if mask is not None:
                attn = attn.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else attn + mask
            attn = self.attn_drop(attn.softmax(dim=-1))
            x = attn @ v
        x = x.transpose(1, 2).reshape(b, n, self.local_heads * self.head_dim)
        x = self.norm(x)
        return self.proj_drop(self.proj(x))


KINDS = ("llama_attention", "gated_mlp", "gpt2_attention", "conv1d_mlp", "fused_qkv_attention", "mlp")

_HF = "transformers.models."
KNOWN: dict[tuple[str, str], str] = {
    (_HF + "llama.modeling_llama", "LlamaAttention"): "llama_attention",
    (_HF + "mistral.modeling_mistral", "MistralAttention"): "llama_attention",
    (_HF + "llama.modeling_llama", "LlamaMLP"): "gated_mlp",
    (_HF + "mistral.modeling_mistral", "MistralMLP"): "gated_mlp",
    (_HF + "gpt2.modeling_gpt2", "GPT2Attention"): "gpt2_attention",
    (_HF + "gpt2.modeling_gpt2", "GPT2MLP"): "conv1d_mlp",
    ("timm.layers.attention", "Attention"): "fused_qkv_attention",
    ("timm.models.vision_transformer", "Attention"): "fused_qkv_attention",
    ("timm.layers.mlp", "Mlp"): "mlp",
}
_REGISTERED: dict[type, str] = {}
_ATTN_IMPLS = ("eager", "sdpa")


def register_block(cls: type[nn.Module], kind: str) -> type[nn.Module]:
    """Declare that ``cls`` has the structure and ``forward`` of block ``kind`` (one of
    :data:`KINDS`), so ``parallelize`` shards its instances as that block."""
    if kind not in KINDS:
        raise ValueError(f"unknown block kind {kind!r}; one of {', '.join(KINDS)}")
    _REGISTERED[cls] = kind
    return cls


def block_kind(m: nn.Module, path: str = "") -> str | None:
    """The recognised kind of ``m`` (see the module docstring), ``None`` if not one; a
    ConfigError for a recognised class whose ``forward`` a subclass overrides."""
    for cls in type(m).__mro__:
        kind = _REGISTERED.get(cls) or KNOWN.get((cls.__module__, cls.__qualname__))
        if kind is None:
            continue
        if type(m).forward is not cls.forward:  # type: ignore[attr-defined]
            raise ConfigError([("model", (
                f"{module_where(path, m)} is a {cls.__qualname__} whose forward is overridden, so "
                "parallelize cannot prove that sharding it keeps its function; keep it whole with "
                f'[tensor_parallel.plan] "{path.rstrip(".")}" = "replicate", or shard its '
                "projections with plan entries"))])
        return kind
    return None


def _fail(path: str, m: nn.Module, why: str, field: str = "model") -> ConfigError:
    return ConfigError([(field, f"{module_where(path, m)}: cannot be sharded with the same function: {why}")])


def _linears(path: str, m: nn.Module, names: tuple[str, ...], conv1d: bool = False) -> list[nn.Module]:
    out = []
    for n in names:
        sub = getattr(m, n, None)
        ok = is_conv1d(sub) if conv1d else is_plain_linear(sub)
        if not ok or sub is None:
            raise _fail(path, m, f"{n} is not a plain {'Conv1D' if conv1d else 'nn.Linear'}")
        out.append(sub)
    return out


def _only(path: str, m: nn.Module, owners: list[nn.Module]) -> None:
    extra = foreign_tensors(m, owners)
    if extra:
        raise _fail(path, m, f"it holds parameters or buffers outside its projections: {', '.join(extra)}")


def _elementwise(path: str, m: nn.Module, name: str) -> None:
    act = getattr(m, name, None)
    hf_act = (isinstance(act, nn.Module) and type(act).__module__ == "transformers.activations"
              and next(act.parameters(), None) is None)
    if not (is_elementwise(act) or hf_act):
        raise _fail(path, m, f"{name} ({type(act).__name__}) is not a known element-wise activation")


def _impl(path: str, m: nn.Module) -> None:
    impl = getattr(getattr(m, "config", None), "_attn_implementation", None) or "eager"
    if impl not in _ATTN_IMPLS:
        raise _fail(path, m, f"attention implementation {impl!r} (only {' / '.join(_ATTN_IMPLS)} "
                             "are known to read nothing but the local heads)")


def _heads(path: str, m: nn.Module, what: str, n: int, p: int) -> None:
    if n % p:
        raise _fail(path, m, f"{what} {n} is not divisible by tensor_parallel_size {p} (each rank "
                             "keeps whole heads)", field="tensor_parallel.tensor_parallel_size")


def _identity(path: str, m: nn.Module, name: str) -> None:
    sub = getattr(m, name, None)
    if sub is not None and type(sub) is not nn.Identity:
        raise _fail(path, m, f"{name} ({type(sub).__name__}) normalises the whole width, which a "
                             "shard does not hold")


def _children(path: str, m: nn.Module, allowed: set[str]) -> None:
    """Only the submodules the known forward runs (another version's extra parts, e.g.
    timm's rotary embeddings or a per-head norm, would be dropped or read whole heads)."""
    extra = sorted(n for n, _ in m.named_children() if n not in allowed)
    if extra:
        raise _fail(path, m, f"submodules {', '.join(extra)} are not part of the known forward")


def _local(m: nn.Module, names: tuple[str, ...], p: int) -> None:
    """Divide the integer head-count attributes the module has by ``p`` (the local counts)."""
    for name in names:
        v = getattr(m, name, None)
        if isinstance(v, int) and not isinstance(v, bool):
            setattr(m, name, v // p)


def shard_block(kind: str, m: nn.Module, path: str, comm: TPComm,
                state: RegionState) -> tuple[nn.Module, str]:
    """Shard block ``m`` of ``kind`` (the module itself, changed in place, or its
    replacement) and a one-line note of what each rank keeps."""
    p = comm.size
    kw: dict[str, Any] = {"comm": comm, "state": state}
    if kind == "llama_attention":
        q, k, v, o = _linears(path, m, ("q_proj", "k_proj", "v_proj", "o_proj"))
        _only(path, m, [q, k, v, o])
        _children(path, m, {"q_proj", "k_proj", "v_proj", "o_proj"})
        _impl(path, m)
        hd = int(m.head_dim)  # type: ignore[arg-type]
        heads, kv = int(q.out_features) // hd, int(k.out_features) // hd  # type: ignore[arg-type]
        _heads(path, m, "num_key_value_heads", kv, p)
        _heads(path, m, "num_attention_heads", heads, p)
        for name, lin in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
            setattr(m, name, ColumnParallelLinear.from_dense(lin, **kw))
        m.o_proj = RowParallelLinear.from_dense(o, **kw)
        _local(m, ("num_heads", "num_attention_heads", "num_key_value_heads"), p)
        return m, (f"q_proj/k_proj/v_proj colwise, o_proj rowwise: {heads} heads -> {heads // p}, "
                   f"{kv} kv heads -> {kv // p} per rank")
    if kind == "gated_mlp":
        gate, up, down = _linears(path, m, ("gate_proj", "up_proj", "down_proj"))
        _only(path, m, [gate, up, down])
        _children(path, m, {"gate_proj", "up_proj", "down_proj", "act_fn"})
        _elementwise(path, m, "act_fn")
        m.gate_proj, m.up_proj = (ColumnParallelLinear.from_dense(lin, **kw) for lin in (gate, up))
        m.down_proj = RowParallelLinear.from_dense(down, **kw)
        return m, "gate_proj/up_proj colwise, down_proj rowwise"
    if kind == "gpt2_attention":
        if getattr(m, "is_cross_attention", False) or hasattr(m, "q_attn"):
            raise _fail(path, m, "cross-attention (q_attn) is not sharded; keep it whole with a "
                                 "plan entry \"replicate\"")
        c_attn, c_proj = _linears(path, m, ("c_attn", "c_proj"), conv1d=True)
        _only(path, m, [c_attn, c_proj])
        _children(path, m, {"c_attn", "c_proj", "attn_dropout", "resid_dropout"})
        _impl(path, m)
        heads, hd = int(m.num_heads), int(m.head_dim)  # type: ignore[arg-type]
        _heads(path, m, "num_attention_heads", heads, p)
        m.c_attn = PackedColumnParallel(c_attn, 3, unit=hd, **kw)
        m.c_proj = RowParallelConv1D.from_dense(c_proj, **kw)
        _local(m, ("split_size", "num_heads", "embed_dim"), p)
        return m, (f"c_attn packed colwise (q|k|v by heads, Conv1D), c_proj rowwise: {heads} heads -> "
                   f"{heads // p} per rank")
    if kind == "conv1d_mlp":
        c_fc, c_proj = _linears(path, m, ("c_fc", "c_proj"), conv1d=True)
        _only(path, m, [c_fc, c_proj])
        _children(path, m, {"c_fc", "c_proj", "act", "dropout"})
        _elementwise(path, m, "act")
        m.c_fc = ColumnParallelConv1D.from_dense(c_fc, **kw)
        m.c_proj = RowParallelConv1D.from_dense(c_proj, **kw)
        return m, "c_fc colwise, c_proj rowwise (Conv1D)"
    if kind == "fused_qkv_attention":
        qkv, proj = _linears(path, m, ("qkv", "proj"))
        if int(qkv.out_features) != 3 * int(qkv.in_features):  # type: ignore[arg-type]
            raise _fail(path, m, "qkv does not have 3 x its input features (not a packed q|k|v)")
        norms = [getattr(m, n) for n in ("q_norm", "k_norm")]
        hd = int(m.head_dim)  # type: ignore[arg-type]
        for name, nm in zip(("q_norm", "k_norm"), norms, strict=True):
            shape = tuple(getattr(nm, "normalized_shape", ()) or ())
            if type(nm) is not nn.Identity and shape != (hd,):
                raise _fail(path, m, f"{name} ({type(nm).__name__}) does not act per head")
        _identity(path, m, "norm")
        _children(path, m, {"qkv", "q_norm", "k_norm", "attn_drop", "norm", "proj", "proj_drop"})
        _only(path, m, [qkv, proj, *norms])
        heads = int(m.num_heads)  # type: ignore[arg-type]
        _heads(path, m, "num_heads", heads, p)
        return (ParallelFusedQKVAttention(m, **kw),
                f"qkv packed colwise (q|k|v by heads), proj rowwise: {heads} heads -> {heads // p} per rank")
    if kind == "mlp":
        fc1, fc2 = _linears(path, m, ("fc1", "fc2"))
        _elementwise(path, m, "act")
        _identity(path, m, "norm")
        _children(path, m, {"fc1", "act", "drop1", "norm", "fc2", "drop2"})
        _only(path, m, [fc1, fc2])
        m.fc1 = ColumnParallelLinear.from_dense(fc1, **kw)
        m.fc2 = RowParallelLinear.from_dense(fc2, **kw)
        return m, "fc1 colwise, fc2 rowwise"
    raise ValueError(f"unknown block kind {kind!r}")
