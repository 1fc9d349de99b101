"""Tiny Hugging Face models built from a config (no download), as a ``[model] factory``
names them: ``factory = "hf_factories:gpt2"`` / ``"hf_factories:llama"``. The factories
take only the documented keywords they need (``num_classes`` = the vocabulary size under
the ``language_model`` task, ``input_shape = (T,)``) and return the raw transformers model:
no wrapper, its ``CausalLMOutput`` goes to the task as it is."""

from __future__ import annotations

from typing import Any


def gpt2(num_classes: int, input_shape: tuple[int, ...], *, layers: int = 2, hidden: int = 32,
         heads: int = 2) -> Any:
    """``GPT2LMHeadModel`` with ``layers`` blocks of width ``hidden`` (tied head)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=num_classes, n_positions=int(input_shape[0]), n_embd=hidden,
                     bos_token_id=None, eos_token_id=None,
                     n_layer=layers, n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def llama(num_classes: int, *, layers: int = 2, hidden: int = 32, heads: int = 4,
          kv_heads: int = 2) -> Any:
    """``LlamaForCausalLM`` with ``layers`` decoder layers of width ``hidden`` (grouped-query
    attention: ``kv_heads`` key/value heads); takes no ``input_shape`` (rotary positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=num_classes, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(cfg)


def tiny_text(*, seed: int, block_size: int, dicts: bool = False) -> tuple[Any, Any]:
    """A slice of the shakespeare corpus (a ``language_model`` data factory): 8,000 training
    and 1,500 test characters. ``dicts``: Hugging Face style items ``{"input_ids": x,
    "labels": x}`` (the model shifts the labels itself and returns its own loss)."""
    from paratrain.data.shakespeare import CharBlocks, load_corpus

    del seed
    c = load_corpus()
    kw = {"block_size": block_size, "vocab": c.vocab}
    train, test = CharBlocks(c.train[:8_000], **kw), CharBlocks(c.test[:1_500], **kw)
    return (_Dicts(train), _Dicts(test)) if dicts else (train, test)


class _Dicts:
    """``{"input_ids", "labels"}`` items over a CharBlocks (``vocab_size`` passed on)."""

    def __init__(self, blocks: Any) -> None:
        self.blocks, self.vocab_size = blocks, blocks.vocab_size

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, _ = self.blocks[i]
        return {"input_ids": x, "labels": x}


def wrapped(num_classes: int, input_shape: tuple[int, ...], *, kind: str = "gpt2", hidden: int = 16) -> Any:
    """A user's own ``nn.Module`` holding a raw HF ``kind`` (``gpt2`` / ``llama``) as ``self.hf``,
    whose forward returns ``self.hf(ids).logits``: torch.export lifts literal tensors of the
    HF attention as constants of the wrapper's graph, which the user's model does not hold."""
    from torch import nn

    class UserWrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.hf = (gpt2(num_classes, input_shape, hidden=hidden) if kind == "gpt2"
                       else llama(num_classes, hidden=hidden))

        def forward(self, ids: Any) -> Any:
            return self.hf(ids).logits

    return UserWrapper()
