"""Small models for 8x8 digits and similar inputs, each an ``nn.Sequential`` of named nodes:
``mlp`` (``norm = "batch"``/``"layer"`` after each hidden Linear: the layers FedBN keeps
local), ``cnn``, ``transformer`` (the image's rows as tokens), ``gpt``
(:mod:`paratrain.models.gpt`) and ``hf``; and a user's ``factory = "module:function"``.

``hf``: a transformers ``AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture,
**keys))`` with the data's vocabulary (the task's ``num_classes``), no download: the raw
module, which the strategies shard and place by its own module names. Token ids outside the
small vocabulary are unset, and the context must hold ``block_size`` tokens or the build fails
naming it. transformers is the optional ``hf`` extra, imported only when a job asks for it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import ConfigError
from ..config.job import ModelSpec
from .gpt import gpt


def import_object(ref: str, *, field: str) -> Any:
    """Import ``"package.module:attribute"``; ConfigError names ``field`` on failure."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError([(field, f"expected 'module:function' (got {ref!r})")])
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError([(field, f"cannot import {module_name!r}: {e}")]) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError([(field, f"{module_name!r} has no attribute {attr!r}")]) from None


def call_factory(fn: Any, ref: str, *, field: str, offered: dict[str, Any],
                 kwargs: dict[str, Any]) -> Any:
    """``fn(**offered, **kwargs)``: a user factory gets the documented keywords ``offered`` it
    accepts (all with ``**kwargs``: a factory may take any subset) and the section's own
    ``kwargs`` (always); a keyword it requires that is neither, or a section key it does not
    take, is a ConfigError naming ``field``, the factory and the keyword (not a TypeError)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        params = None
    if params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        given = {**offered, **kwargs}
    else:
        named = {n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                            inspect.Parameter.KEYWORD_ONLY)}
        unexpected = [k for k in kwargs if k not in named]
        if unexpected:
            raise ConfigError([(field, f"factory {ref!r} takes no keyword {unexpected[0]!r} "
                                       f"(it takes: {', '.join(sorted(named)) or 'none'})")])
        given = {**{k: v for k, v in offered.items() if k in named}, **kwargs}
        missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                   and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                   and n not in given]
        if missing:
            documented = ", ".join(offered) or "none"
            raise ConfigError([(field, f"factory {ref!r} requires {missing[0]!r}, which is not "
                                       f"given (a {field.split('.')[0]} factory is called with "
                                       f"the keywords it accepts of: {documented}, plus the "
                                       f"section's own keys)")])
    try:
        return fn(**given)
    except TypeError as e:
        raise ConfigError([(field, f"factory {ref!r} rejected its arguments: {e}")]) from None


class MeanPool(nn.Module):
    """Mean over the sequence dimension: (B, T, D) -> (B, D)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def mlp(input_shape: tuple[int, ...], num_classes: int, *, hidden: list[int] | None = None,
        activation: str = "relu", dropout: float = 0.0, norm: str | None = None) -> nn.Sequential:
    hidden = [64] if hidden is None else list(hidden)
    acts: dict[str, Callable[[], nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}
    if activation not in acts:
        raise ConfigError([("model.activation", f"unknown {activation!r}; valid: {', '.join(acts)}")])
    norms: dict[str, Callable[[int], nn.Module]] = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm}
    if norm is not None and norm not in norms:
        raise ConfigError([("model.norm", f"unknown {norm!r}; valid: {', '.join(norms)} (or unset)")])
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    width = math.prod(input_shape)
    for i, h in enumerate(hidden):
        layers[f"fc{i}"] = nn.Linear(width, h)
        if norm is not None:
            layers[f"norm{i}"] = norms[norm](h)
        layers[f"act{i}"] = acts[activation]()
        if dropout > 0:
            layers[f"drop{i}"] = nn.Dropout(dropout)
        width = h
    layers["head"] = nn.Linear(width, num_classes)
    return nn.Sequential(layers)


def cnn(input_shape: tuple[int, ...], num_classes: int, *,
        channels: list[int] | None = None) -> nn.Sequential:
    channels = [16, 32] if channels is None else list(channels)
    side = int(math.isqrt(math.prod(input_shape)))
    if side * side != math.prod(input_shape):
        raise ConfigError([("model.name", f"cnn needs square single-channel images (got {input_shape})")])
    layers: OrderedDict[str, nn.Module] = OrderedDict(unflatten=nn.Unflatten(1, (1, side, side)))
    c_in = 1
    for i, c in enumerate(channels):
        layers[f"conv{i}"] = nn.Conv2d(c_in, c, 3, padding=1)
        layers[f"act{i}"] = nn.ReLU()
        if side >= 2:
            layers[f"pool{i}"] = nn.MaxPool2d(2)
            side //= 2
        c_in = c
    layers["flatten"] = nn.Flatten()
    layers["head"] = nn.Linear(c_in * side * side, num_classes)
    return nn.Sequential(layers)


def transformer(input_shape: tuple[int, ...], num_classes: int, *, d_model: int = 32,
                heads: int = 4, layers: int = 2, seq_len: int | None = None) -> nn.Sequential:
    n = math.prod(input_shape)
    seq = seq_len or int(math.isqrt(n))
    if n % seq:
        raise ConfigError([("model.seq_len", f"{n} features do not split into {seq} tokens")])
    mods: OrderedDict[str, nn.Module] = OrderedDict(
        tokens=nn.Unflatten(1, (seq, n // seq)), embed=nn.Linear(n // seq, d_model)
    )
    for i in range(layers):
        mods[f"block{i}"] = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )
    mods["pool"] = MeanPool()
    mods["head"] = nn.Linear(d_model, num_classes)
    return nn.Sequential(mods)


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_causal_lm(input_shape: tuple[int, ...], num_classes: int, *,
                 architecture: str | None = None, **config: Any) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` of ``architecture`` with vocabulary
    ``num_classes`` over blocks of ``input_shape[0]`` token ids (module docstring)."""
    try:
        import transformers as tf
    except ImportError:
        raise ConfigError([("model.name", "'hf' needs the transformers package: pip install "
                                          "'paratrain[hf]'")]) from None
    if not architecture:
        raise ConfigError([("model.architecture", "'hf' needs architecture = a transformers "
                                                  "model_type, e.g. 'llama' or 'gpt2'")])
    if "vocab_size" in config:
        raise ConfigError([("model.vocab_size", "comes from the data (the task's vocabulary); "
                                                "remove it")])
    for key in _TOKEN_IDS:
        v = config.get(key)
        if isinstance(v, int) and not 0 <= v < num_classes:
            raise ConfigError([(f"model.{key}", f"{v} is outside the vocabulary [0, {num_classes})")])
    try:  # built at the architecture's own vocabulary, then resized: no warning about its ids
        cfg = tf.AutoConfig.for_model(architecture, **config)
    except ValueError as e:
        first = str(e).splitlines()[0].split(". Should contain")[0]
        raise ConfigError([("model.architecture", f"{architecture!r}: {first}")]) from None
    except TypeError as e:
        raise ConfigError([("model", f"{architecture!r} config rejected its keys: {e}")]) from None
    cfg.vocab_size = int(num_classes)
    for key in _TOKEN_IDS:  # a default id of a big vocabulary (GPT-2's 50256) means nothing here
        v = getattr(cfg, key, None)
        if key not in config and isinstance(v, int) and not 0 <= v < num_classes:
            setattr(cfg, key, None)
    context = getattr(cfg, "max_position_embeddings", None)
    if input_shape and isinstance(context, int) and context < int(input_shape[-1]):
        raise ConfigError([("model.max_position_embeddings",
                            f"{context} positions cannot hold blocks of {input_shape[-1]} tokens "
                            "(task.block_size)")])
    try:
        model: nn.Module = tf.AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:
        raise ConfigError([("model.architecture", f"{architecture!r} has no causal-LM head: "
                                                  f"{str(e).splitlines()[0]}")]) from None
    return model


MODELS: dict[str, Callable[..., nn.Module]] = {
    "mlp": mlp, "cnn": cnn, "transformer": transformer, "gpt": gpt, "hf": hf_causal_lm,
}


def build_model(spec: ModelSpec, *, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the model a job names (zoo ``name`` or ``factory``), with the spec's kwargs. A
    factory gets those of ``input_shape=`` (one example's shape) and ``num_classes=`` (the
    classes, regression targets or vocabulary size) its signature accepts
    (:func:`call_factory`)."""
    kwargs = spec.kwargs
    if spec.factory is not None:
        fn = import_object(spec.factory, field="model.factory")
        model = call_factory(fn, spec.factory, field="model.factory",
                             offered={"input_shape": input_shape, "num_classes": num_classes},
                             kwargs=kwargs)
    else:
        if spec.name not in MODELS:
            raise ConfigError([("model.name", f"unknown model {spec.name!r}; valid: {', '.join(MODELS)}")])
        try:
            model = MODELS[spec.name](input_shape, num_classes, **kwargs)
        except TypeError as e:
            raise ConfigError([("model", f"{spec.name!r} rejected its arguments: {e}")]) from None
    if not isinstance(model, nn.Module):
        raise ConfigError([("model.factory", f"must return an nn.Module (got {type(model).__name__})")])
    return model
