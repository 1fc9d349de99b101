"""Blocks written by others that ``parallelize`` shards without a plan (the table is in
docs/tensor-parallel.md; Megatron's layout, as HF's own ``base_model_tp_plan``).

A block is recognised by its class (transformers' by module and name, without importing it)
*and* by its ``forward`` being that class's own: an overriding subclass may compute something
else, so it is a ConfigError naming its path, as is a block with submodules, parameters or
buffers its known forward lacks. HF's forwards run unchanged on the shard (they reshape with
``-1`` heads; the head counts become the local ones): in grouped-query attention rank ``r``
keeps query heads ``[rH/p, (r+1)H/p)`` and kv heads ``[rK/p, (r+1)K/p)``, exactly those its
query heads read (``h // (H/K)``), and only the ``eager`` / ``sdpa`` implementations are known
to read nothing else. :func:`register_block` declares another class to be one of these blocks.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from paratrain.comm.tp.comm import TPComm
from paratrain.config import ConfigError

from .foreign_layers import (
    ColumnParallelConv1D,
    PackedColumnParallel,
    ParallelFusedQKVAttention,
    RowParallelConv1D,
    is_conv1d,
)
from .layers import ColumnParallelLinear, RegionState, RowParallelLinear
from .rules import foreign_tensors, is_elementwise, is_plain_linear, module_where

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
        m.gate_proj = ColumnParallelLinear.from_dense(gate, **kw)
        m.up_proj = ColumnParallelLinear.from_dense(up, **kw)
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
