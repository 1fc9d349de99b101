"""Hugging Face causal language models built from a config, no download: ``[model] name = "hf"``.

``AutoModelForCausalLM.from_config(AutoConfig.for_model(architecture, **keys))`` with the
data's vocabulary (the task's ``num_classes``), seeded like every model: the raw transformers
module, which the strategies shard and place by its own module names. Token ids outside the
small vocabulary are unset, and the context must hold ``block_size`` tokens or the build fails
naming it. transformers is the optional ``hf`` extra, imported only when a job asks for it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import ConfigError

_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_causal_lm(input_shape: tuple[int, ...], num_classes: int, *,
                 architecture: str | None = None, **config: Any) -> nn.Module:
    """A randomly initialised ``AutoModelForCausalLM`` of ``architecture`` with vocabulary
    ``num_classes`` over blocks of ``input_shape[0]`` token ids (see the module docstring)."""
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
