"""Greedy answers to many prompts at once on the served kernels, with continuous batching.

Up to `batch` sequences advance one token a step through the engine's own layer stack
(`Stack.forward_rows` in `csrc/layers.cpp`): the projections read their weights once for all rows,
each row attends its own KV cache. A finished sequence (EOS or its budget) leaves at once and the
next prompt takes its slot (its prompt prefilled as the engine prefills one), so the batch stays
full. The kernels compute each row alone, so a batched answer is, token for token and bit for bit,
the answer the engine's `ar` decode gives that prompt alone (`tests/test_batch.py`), which is the
served model's `generate`.

It applies where the engine runs the fused stack (a Llama served from GGUF blocks on a CPU: the
default model); `available(model)` says whether it does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from entmtp.model import forward, kernels, kv

MAX_BATCH = 64  # the LM head's Q8 kernels take at most 64 rows a call (more go through float32: other bits)


def available(model) -> bool:
    """Whether `model` is served by the fused layer stack that batched decoding runs on."""
    return model.__dict__.get("_entmtp_stack") is not None


@dataclass
class Answer:
    """One prompt's greedy answer: its index among the prompts, the new tokens (EOS kept), the final
    hidden state before each of them (n, H) where asked for, and why it stopped."""

    index: int
    tokens: list[int]
    hidden: torch.Tensor | None
    stop_reason: str
    elapsed_s: float = 0.0  # from its prefill to its last token, decoded beside the others


@dataclass
class _Slot:
    index: int
    cache: object
    past: int
    budget: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


class BatchDecoder:
    """Greedy decoding of many prompts, `batch` at a time, on a fused model's stack."""

    def __init__(self, model, eos: Iterable[int] = (), batch: int = 32, keep_hidden: bool = False):
        if not available(model):
            raise ValueError("batched decoding needs the fused layer stack (a Llama served from GGUF blocks on a CPU)")
        if not 1 <= batch <= MAX_BATCH:
            raise ValueError(f"batch must be 1..{MAX_BATCH}, got {batch}")
        self.model, self.eos, self.batch, self.keep_hidden = model, {int(t) for t in eos}, batch, keep_hidden
        self.stack = model.__dict__["_entmtp_stack"]
        cfg = model.config
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 1 << 30))
        attn = model.model.layers[0].self_attn
        self.kv_heads, self.dim = cfg.num_key_value_heads, attn.head_dim

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int,
            on_token: Callable[[int], None] | None = None) -> Iterator[Answer]:
        """Answers as they finish (not in prompt order). `on_token(n)`: n new tokens were decoded
        (a progress bar's hook)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.max_positions:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {self.max_positions}")
        queue = list(range(len(prompts)))[::-1]
        slots: list[_Slot] = []
        nxt: list[int] = []  # each slot's next token (decoded, not yet fed)
        while queue or slots:
            while queue and len(slots) < self.batch:  # fill the free slots: prefill as the engine does
                i = queue.pop()
                ids = prompts[i]
                slot = _Slot(i, kv.new_cache(self.model.config), len(ids), min(max_new_tokens, self.max_positions - len(ids)))
                hidden, logits = forward.forward(self.model, slot.cache, torch.tensor([ids]), torch.arange(len(ids))[None], None,
                                                 last_only=True)
                token = int(kernels.argmax_rows(logits[-1:])[0])
                done = self._take(slot, token, hidden[-1])
                if on_token:
                    on_token(1)
                if done:
                    yield done
                    continue
                slots.append(slot)
                nxt.append(token)
            if not slots:
                continue
            hidden, logits = self._step(slots, nxt)
            tokens = kernels.argmax_rows(logits).tolist()
            if on_token:
                on_token(len(slots))
            kept, kept_next = [], []
            for b, (slot, token) in enumerate(zip(slots, tokens)):
                done = self._take(slot, token, hidden[b])
                if done:
                    yield done
                else:
                    kept.append(slot)
                    kept_next.append(token)
            slots, nxt = kept, kept_next

    def _take(self, slot: _Slot, token: int, hidden: torch.Tensor) -> Answer | None:
        """Record the slot's next token (and the state that predicted it); its answer if it is done."""
        slot.tokens.append(token)
        if self.keep_hidden:
            slot.hidden.append(hidden.clone())
        reason = "eos" if token in self.eos else "length" if len(slot.tokens) >= slot.budget else ""
        if not reason:
            return None
        states = torch.stack(slot.hidden) if self.keep_hidden else None
        return Answer(slot.index, slot.tokens, states, reason, time.perf_counter() - slot.started)

    def _step(self, slots: list[_Slot], nxt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each slot its next token: one pass of the stack over all rows. -> hidden (B, H), logits (B, V)."""
        model = self.model
        ids = torch.tensor([nxt])  # (1, B)
        pasts = [s.past for s in slots]
        pos = torch.tensor([pasts])  # (1, B): each row at its own position
        x = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary_emb(x, position_ids=pos)
        keys, values = [], []
        for s in slots:
            for layer in s.cache.layers:
                k, v = layer.make_room(1, self.kv_heads, self.dim, x.dtype, x.device)
                keys.append(k)
                values.append(v)
        out = self.stack.forward_rows(x[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(), keys, values, pasts)
        for s in slots:
            for layer in s.cache.layers:
                layer.advance(1)
            s.past += 1
        hidden = model.model.norm(out)
        return hidden, model.get_output_embeddings()(hidden)
