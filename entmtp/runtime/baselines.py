"""transformers `generate` and its prompt-lookup decoding, traced per step like the engine.

The streamer receives the tokens accepted by each forward as one chunk, so each chunk is one
step. `generate` runs in a worker thread and its chunks are yielded as `StepRecord`s.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext
from typing import Iterator

import torch
from transformers.generation.streamers import BaseStreamer

from entmtp.config import GenerationConfig, PromptLookupConfig
from entmtp.spec.engine import StepRecord
from entmtp.model.kernels import stock_kernels


class _ChunkStreamer(BaseStreamer):
    def __init__(self, out: "queue.Queue"):
        self.out, self.prompt_seen = out, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.out.put(("tokens", time.perf_counter(), value.flatten().tolist()))

    def end(self) -> None:
        self.out.put(("end", time.perf_counter(), None))


def hf_generate(
    model,
    prompt_ids: list[int],
    gen: GenerationConfig = GenerationConfig(),
    lookup: PromptLookupConfig | None = None,
    pad_token_id: int | None = None,
    stock: bool = True,
) -> Iterator[StepRecord]:
    """`model.generate` (greedy, or sampling at temperature > 0), one record per forward; `stock`:
    with PyTorch's own kernels, as a user of transformers runs the model, else on the model as
    served (the engine's kernels inside transformers' forward: the losslessness oracle)."""
    name = "hf-lookup" if lookup else "hf"
    device = model.get_output_embeddings().weight.device
    out: queue.Queue = queue.Queue()
    kwargs = dict(
        max_new_tokens=gen.max_new_tokens,
        do_sample=gen.temperature > 0,
        streamer=_ChunkStreamer(out),
        pad_token_id=pad_token_id if pad_token_id is not None else model.generation_config.pad_token_id,
    )
    if gen.temperature > 0:
        kwargs.update(temperature=gen.temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if lookup:
        kwargs.update(prompt_lookup_num_tokens=lookup.num_tokens, max_matching_ngram_size=lookup.max_ngram_size)
    ids = torch.tensor([prompt_ids], device=device)

    def work() -> None:
        try:
            if gen.temperature > 0:
                torch.manual_seed(gen.seed)
            with torch.inference_mode(), stock_kernels() if stock else nullcontext():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        except Exception as e:  # handed to the consuming thread, which re-raises it
            out.put(("error", time.perf_counter(), e))

    t_start = time.perf_counter()
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    step, produced, last = 0, 0, t_start
    try:
        while True:
            kind, t, payload = out.get()
            if kind == "error":
                raise payload
            if kind == "end":
                return
            step += 1
            produced += len(payload)
            yield StepRecord(
                step=step,
                tokens=payload,
                tree=name,
                tree_index=0,
                tree_nodes=1 + (lookup.num_tokens if lookup else 0),
                s=float("nan"),
                entropy=float("nan"),
                path_value=float("nan"),
                feature=float("nan"),
                accepted=len(payload),
                accepted_nodes=list(range(len(payload))),
                draft_tokens=payload,
                ms={"total": (t - last) * 1e3},
                step_ms=(t - last) * 1e3,
                elapsed_s=t - t_start,
                prefill_ms=0.0,
                finished=produced >= gen.max_new_tokens,
            )
            last = t
    finally:
        worker.join()
