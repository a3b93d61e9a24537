"""Greedy answers to many prompts at once on the served kernels, with continuous batching.

Up to `batch` sequences advance one token a step through the engine's own layer stack
(`Stack.forward_rows` in `csrc/layers.cpp`): the projections read their weights once for all rows,
and each row attends its own keys and values, a slot of two pools made once a run. A finished
sequence (EOS or its budget) leaves at once and the next prompt takes its slot (prefilled as the
engine prefills a prompt), so the batch stays full. The kernels compute each row alone, so a
batched answer is, token for token and bit for bit, the answer the engine's `ar` decode gives that
prompt alone (`tests/test_batch.py`), which is the served model's `generate`.

Prefill is shared where the prompts allow, with the same bits, because a block's rows and each
query's keys are computed in the same order whatever the block: the prompts' common opening (the
chat template's system turn) is prefilled once and copied into each slot, and a prompt given a
parent (a conversation's previous turn, which it begins with) continues that turn's slot.
`read_back` reads given answers back teacher-forced, one block a sequence.

It applies where the engine runs the fused stack (a Llama served from GGUF blocks on a CPU: the
default model); `available(model)` says whether it does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from entmtp.model import decoder, kernels

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
    slot: int  # its place in the key/value pools
    past: int
    budget: int
    tokens: list[int] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)


class _PoolLayer:
    """One layer of one slot of the pools, read by `decoder.stack_forward` as a cache layer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    def make_room(self, n, kv_heads, dim, dtype, device):
        return self.keys, self.values

    def advance(self, n: int) -> None:
        pass


MIN_SHARED = 8  # a common opening shorter than this is prefilled with each prompt


def extends(prompt: list[int], parent: list[int]) -> bool:
    """Whether `prompt` begins with the whole of `parent` and goes on (a conversation's later turn)."""
    return len(parent) < len(prompt) and prompt[: len(parent)] == parent


def _parents(prompts: list[list[int]], parents: list[int | None] | None) -> list[int | None]:
    """`parents` checked (each an earlier prompt its child extends), or none for every prompt."""
    parents = list(parents) if parents is not None else [None] * len(prompts)
    if len(parents) != len(prompts):
        raise ValueError(f"{len(parents)} parents for {len(prompts)} prompts")
    for i, up in enumerate(parents):
        if up is not None and not (0 <= up < i and extends(prompts[i], prompts[up])):
            raise ValueError(f"prompt {i} does not extend its parent {up} (an earlier, shorter prompt it begins with)")
    return parents


def common_opening(prompts: list[list[int]]) -> int:
    """How many opening tokens every prompt shares, leaving each at least one of its own (0 when
    under MIN_SHARED or for a single prompt)."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n if n >= MIN_SHARED else 0


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
        self.layers, self.kv_heads, self.dim = cfg.num_hidden_layers, cfg.num_key_value_heads, attn.head_dim
        self.keys = self.values = torch.empty(0)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_new_tokens: int,
            on_token: Callable[[int], None] | None = None,
            parents: list[int | None] | None = None) -> Iterator[Answer]:
        """Answers as they finish (not in prompt order). `on_token(n)`: n new tokens were decoded
        (a progress bar's hook). `parents[i]`: an earlier prompt that prompt i extends (a
        conversation's previous turn), or None: prompt i then waits for that prompt's answer and
        takes its slot, whose cache still holds the parent prompt, prefilling only its own tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) >= self.max_positions:
                raise ValueError(f"prompt {i} has {len(p)} tokens; the model's context is {self.max_positions}")
        parents = _parents(prompts, parents)
        children: dict[int, list[int]] = {}
        for i, up in enumerate(parents):
            if up is not None:
                children.setdefault(up, []).append(i)
        if not prompts:
            return
        self._pools(min(self.batch, len(prompts)), 256)
        roots = [i for i in range(len(prompts)) if parents[i] is None]
        opening = self._opening([prompts[i] for i in roots])
        ready = roots[::-1]  # prompts whose parent (if any) has answered, next last
        pending: dict[int, int] = {}  # slot -> the child that continues its parent's cache there
        free = list(range(self.keys.shape[0]))[::-1]
        slots: list[_Slot] = []
        nxt: list[int] = []  # each slot's next token (decoded, not yet fed)

        def finished(slot: _Slot) -> None:  # its slot is free; its children are ready, the first in its slot
            free.append(slot.slot)
            kids = children.get(slot.index, [])
            if kids:
                pending[slot.slot] = kids[0]
                ready.extend(kids[:0:-1])

        while ready or pending or slots:
            for s in list(free):  # fill the free slots: prefill as the engine does
                if s in pending:  # the slot's cache holds the parent's prompt: prefill after it
                    i = pending.pop(s)
                    start = len(prompts[parents[i]])
                elif ready:
                    i, start = ready.pop(), 0
                else:
                    continue
                ids = prompts[i]
                free.remove(s)
                slot = _Slot(i, s, len(ids), min(max_new_tokens, self.max_positions - len(ids)))
                self._pools(self.keys.shape[0], len(ids) + slot.budget)
                if not start:
                    start = self._open(s, opening)
                hidden, logits = self._prefill(s, ids[start:], start)
                token = int(kernels.argmax_rows(logits[-1:])[0])
                done = self._take(slot, token, hidden[-1])
                if on_token:
                    on_token(1)
                if done:
                    finished(slot)
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
                    finished(slot)
                    yield done
                else:
                    kept.append(slot)
                    kept_next.append(token)
            slots, nxt = kept, kept_next

    @torch.inference_mode()
    def read_back(self, prompts: list[list[int]], answers: list[list[int]],
                  parents: list[int | None] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Each prompt's given answer read back teacher-forced, in prompt order: (index, the final
        hidden state before each answer token (n, H)). One block a sequence (a prompt and its answer
        but the last token), so ~4x the tokens a second of decoding them; the states are the ones
        decoding keeps (`run(keep_hidden=True)`), bit for bit, since a block's rows are each
        computed alone. `parents` as in `run`: a prompt right after its parent continues the
        parent prompt's cache and prefills only its own tokens (elsewhere it prefills whole)."""
        if len(answers) != len(prompts):
            raise ValueError(f"{len(answers)} answers for {len(prompts)} prompts")
        parents = _parents(prompts, parents)
        for i, (p, a) in enumerate(zip(prompts, answers)):
            if not p or not a:
                raise ValueError(f"prompt {i} or its answer is empty")
            if len(p) + len(a) > self.max_positions:
                raise ValueError(f"prompt {i} and its answer have {len(p) + len(a)} tokens; the model's context is {self.max_positions}")
        if not prompts:
            return
        self._pools(1, max(len(p) + len(a) for p, a in zip(prompts, answers)))
        opening = self._opening([prompts[i] for i in range(len(prompts)) if parents[i] is None])
        last = None
        for i, (p, a) in enumerate(zip(prompts, answers)):
            up = parents[i]
            if up is not None and up == last:  # the slot still holds the parent's prompt
                start = len(prompts[up])
            elif opening is not None and p[: len(opening[0])] == opening[0]:
                start = self._open(0, opening)
            else:
                start = 0
            hidden, _ = self._prefill(0, (p + a[:-1])[start:], start)
            last = i
            yield i, hidden[len(p) - 1 - start :]

    def _opening(self, prompts: list[list[int]]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """The prompts' common opening prefilled once (in slot 0): (its tokens, keys, values), or None."""
        shared = common_opening(prompts)
        if not shared:
            return None
        self._prefill(0, prompts[0][:shared], 0)
        return prompts[0][:shared], self.keys[0, :, :, :shared].clone(), self.values[0, :, :, :shared].clone()

    def _open(self, slot: int, opening) -> int:
        """Copy the opening into `slot`; -> where its prompt's own prefill starts."""
        if opening is None:
            return 0
        tokens, keys, values = opening
        self.keys[slot, :, :, : len(tokens)] = keys
        self.values[slot, :, :, : len(tokens)] = values
        return len(tokens)

    def _pools(self, slots: int, capacity: int) -> None:
        """The key and value pools [slots, layers, kv_heads, capacity, D], grown (doubling, the
        entries kept) to hold `capacity` positions a slot."""
        have = self.keys.shape[3] if self.keys.dim() == 5 and self.keys.shape[0] == slots else 0
        if capacity <= have:
            return
        cap = max(capacity, 2 * have)
        shape = (slots, self.layers, self.kv_heads, cap, self.dim)
        keys, values = torch.empty(shape), torch.empty(shape)
        if have:
            keys[:, :, :, :have] = self.keys
            values[:, :, :, :have] = self.values
        self.keys, self.values = keys, values

    def _prefill(self, slot: int, ids: list[int], past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `ids` at positions past.. into pool slot `slot`, in one block, as the engine
        prefills a prompt -> hidden (Q, H), the last position's logits (1, V)."""
        model = self.model
        x = model.model.embed_tokens(torch.tensor([ids]))
        cos, sin = model.model.rotary_emb(x, position_ids=torch.arange(past, past + len(ids))[None])
        layers = [_PoolLayer(self.keys[slot, l : l + 1], self.values[slot, l : l + 1]) for l in range(self.layers)]
        return decoder.stack_forward(model, self.stack, layers, x[0], cos[0], sin[0], past, None, last_only=True)

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
        pasts = [s.past for s in slots]
        x = model.model.embed_tokens(torch.tensor([nxt]))  # (1, B, H)
        cos, sin = model.model.rotary_emb(x, position_ids=torch.tensor([pasts]))  # each row at its own position
        out = self.stack.forward_rows(x[0].contiguous(), cos[0].contiguous(), sin[0].contiguous(), self.keys, self.values,
                                      [s.slot for s in slots], pasts)
        for s in slots:
            s.past += 1
        hidden = model.model.norm(out)
        return hidden, model.get_output_embeddings()(hidden)
