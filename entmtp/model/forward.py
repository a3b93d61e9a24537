"""One base forward over a block of tokens, and one commit of a step's accepted entries, whatever
the KV cache: the only place that asks which kind of cache a request holds.

A request's cache is one of two kinds:
- transformers' `DynamicCache` whose full-attention layers are `kv.BufferedLayer`s
  (`kv.new_cache`): CPUs and GPUs without graphs. A Llama on a CPU runs through
  `decoder.lean_forward` (the same arithmetic as transformers, bit for bit, with less overhead);
  everything else through transformers' forward.
- a CUDA-graph slot (`graphs.SlotCache`): static buffers, one graph per (block size, span).

The protocol the decode loop uses: `forward` (a prompt, causal), `block_forward` (a tree block
with its ancestor mask), `commit` (keep the accepted nodes), `prepare` (capture ahead of use).
"""

from __future__ import annotations

from typing import Callable

import torch

from entmtp.model import decoder, graphs, kv


def forward(model, cache, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor | None,
            last_only: bool = False):
    """One base-model forward. input_ids (1, Q) -> final normed hidden (Q, H), logits (Q, V).
    `mask`: None (causal) or a 4-D additive mask [1, 1, Q, past+Q]; a slot runs it eagerly
    (prompts vary in length), reading only the block's own columns (the cached ones are all visible).
    `last_only`: the logits of the last position alone (1, V), as a prompt's decode needs them (and
    as transformers `generate` computes them): the LM head is a fifth of a prompt's arithmetic on
    the default model, and on the GGUF kernels each row's logits are the same bits either way."""
    if isinstance(cache, graphs.SlotCache):
        slot, n = cache.slot, input_ids.shape[1]
        past = slot.length
        block = graphs.causal_block(n, slot.dtype, slot.device) if mask is None else mask[0, 0, :, past:]
        hidden, logits = slot.verify(input_ids[0], position_ids[0] - past, block, graph=False)
        return hidden, logits[-1:] if last_only else logits
    lean = decoder.lean_forward(model, cache, input_ids, position_ids, mask, last_only)
    if lean is not None:
        return lean
    base = model.base_model
    out = base(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **kv.cache_arg(base, cache))
    hidden = out.last_hidden_state[0]
    return hidden, model.get_output_embeddings()(hidden[-1:] if last_only else hidden)


def block_forward(model, cache, tokens: torch.Tensor, depth: torch.Tensor,
                  mask_block: Callable[[torch.dtype, torch.device], torch.Tensor], past: int):
    """A block of N tokens (N,) at positions past + depth (N,), each attending the whole cache
    and the block's columns that `mask_block(dtype, device)` (N, N) leaves at 0 (its ancestors):
    a tree verification. -> hidden (N, H), logits (N, V). On a slot: one CUDA graph per size."""
    device, n = tokens.device, tokens.shape[0]
    if isinstance(cache, graphs.SlotCache):
        return cache.slot.verify(tokens, depth, mask_block(cache.slot.dtype, device), graph=True)
    pos = (depth + past)[None]
    if n == 1:  # plain decoding: the causal default is the mask; keeps generate's exact kernel path
        return forward(model, cache, tokens[None], pos, None)
    dtype = model.get_output_embeddings().weight.dtype
    block = mask_block(dtype, device)  # (N, N): 0 on ancestors (self included), min elsewhere
    mask = torch.cat([torch.zeros(n, past, dtype=dtype, device=device), block], dim=1)[None, None]
    return forward(model, cache, tokens[None], pos, mask)


def commit(cache, past: int, accepted: list[int], n_tree: int) -> None:
    """After a block forward the cache holds past + n_tree entries; keep past + the `accepted`
    block entries (in that order) and drop the rest."""
    if isinstance(cache, graphs.SlotCache):
        cache.slot.commit(past, accepted, n_tree)
    else:
        kv.commit(cache, past, accepted, n_tree)


def prepare(cache, n: int) -> None:
    """Capture a slot's graphs for blocks of `n` at every span up to its capacity, so that no
    request captures mid-decode (a dynamic cache needs nothing)."""
    if isinstance(cache, graphs.SlotCache):
        cache.slot.prepare(n)
