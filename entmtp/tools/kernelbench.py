"""`python -m entmtp kernels`: the served CPU kernels against stock, per tree size, beside what
this machine can hardly beat (streaming the weights once; one multiply-add per weight and row);
and per instruction-set path of the Q8 products, what 1 to 64 rows cost and r, the cost of an
extra row over a one-row step."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn

from entmtp.model import decoder, forward, kv
from entmtp.model.ext import ISA_CODES, extension
from entmtp.model.gguf import GGUFLinear
from entmtp.model.kernels import PackedLinear, stock_kernels
from entmtp.model.serve import set_isa
from entmtp.spec import verify
from entmtp.spec.heads import LM_REFINE
from entmtp.spec.topology import chain_paths, compile_tree

@torch.inference_mode()
def compare(model: nn.Module, sizes: tuple[int, ...], context: int, reps: int, warmup: int = 2) -> dict:
    """Median ms, packed and stock, of one tree verification (a tree of n nodes over `context`
    cached tokens, LM head included: the verify phase of a decode step) and of the LM head alone
    (the largest linear) on n rows, per n in `sizes`. `model` is a CPU model loaded with packed
    kernels; its stock figures run the same weights under `stock_kernels()`, which computes what
    `--kernels stock` does. Sizes and kernels are interleaved per round, the kernels' order
    alternating, so drift of the machine hits both alike."""
    head = model.get_output_embeddings()
    vocab, hidden = head.weight.shape
    context, cache, g = _prefilled(model, context, max(sizes))
    linears = {"packed": _linears(model, as_served=True), "stock": _linears(model)}
    inputs = {n: {f: torch.randn(n, f, generator=g, dtype=head.weight.dtype) for f in {m.in_features for m in linears["stock"]}}
              for n in sizes}
    trees = {n: compile_tree(chain_paths(n - 1), f"chain{n}") for n in sizes}
    tokens = {n: torch.randint(vocab // 8, vocab, (n,), generator=g) for n in sizes}
    rows = {n: torch.randn(1, n, hidden, generator=g, dtype=head.weight.dtype) for n in sizes}
    times: dict[tuple[str, str, int], list[float]] = {}
    for r in range(warmup + reps):
        for n in sizes:
            for kind in ("packed", "stock")[:: 1 if r % 2 else -1]:
                with stock_kernels() if kind == "stock" else nullcontext():
                    t0 = time.perf_counter()
                    verify.tree_forward(model, cache, trees[n], tokens[n], context)
                    t1 = time.perf_counter()
                    forward.commit(cache, context, [], n)  # drop the block: every verification sees the same context
                    t2 = time.perf_counter()
                    head(rows[n])
                    t3 = time.perf_counter()
                    for m in linears[kind]:
                        m.forward(inputs[n][m.in_features])  # the layers' own work, without module-call overhead
                    t4 = time.perf_counter()
                if r >= warmup:
                    times.setdefault(("verify_ms", kind, n), []).append((t1 - t0) * 1e3)
                    times.setdefault(("lm_head_ms", kind, n), []).append((t3 - t2) * 1e3)
                    times.setdefault(("linears_ms", kind, n), []).append((t4 - t3) * 1e3)
    med = {k: round(statistics.median(v), 3) for k, v in times.items()}
    return {"context": context, "reps": reps, "floor": floors(linears["packed"]), "rows": [
        {"nodes": n, **{what: {kind: med[(what, kind, n)] for kind in ("packed", "stock")}
                        for what in ("verify_ms", "lm_head_ms", "linears_ms")}}
        for n in sizes]}


def _prefilled(model: nn.Module, context: int, largest: int) -> tuple[int, object, torch.Generator]:
    """(context, a KV cache holding that many random tokens, the seeded generator that drew them):
    what a verification of up to `largest` rows is timed over; `context` shrinks to fit the model."""
    vocab = model.get_output_embeddings().weight.shape[0]
    context = max(1, min(context, int(getattr(model.config, "max_position_embeddings", 1 << 30)) - largest - 1))
    g = torch.Generator().manual_seed(0)
    cache = kv.new_cache(model.config)
    forward.forward(model, cache, torch.randint(vocab // 8, vocab, (1, context), generator=g), torch.arange(context)[None], None)
    return context, cache, g


def _linears(model: nn.Module, as_served: bool = False) -> list[nn.Module]:
    """The model's linear layers, each once (LM head included); `as_served`: as the engine calls
    them, so for a fused model (`decoder.fuse`) q/k/v and gate/up as one layer each."""
    if as_served and decoder.fused(model):
        out = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            out += [GGUFLinear.concat([attn.q_proj, attn.k_proj, attn.v_proj]), attn.o_proj, mlp.gate_up.layer, mlp.down_proj]
        return out + [model.get_output_embeddings()]
    kinds = (nn.Linear, PackedLinear, GGUFLinear)
    return [m for m in model.modules() if isinstance(m, kinds) and getattr(m, "weight", None) is not None]


def _bytes_read(m: nn.Module) -> int:
    """Bytes one call streams of a layer's weights, in the form the served kernel reads them."""
    if hasattr(m, "nbytes"):  # the heads' `gguf.BlockLinear`
        return m.nbytes()
    if isinstance(m, GGUFLinear):
        return sum(t.numel() * t.element_size() for t in (m.qs, m.d, m.m) if t is not None)
    if isinstance(getattr(m, "weight", None), torch.Tensor):
        return m.weight.numel() * m.weight.element_size()
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


def _sum_buffer() -> torch.Tensor:
    """What the memory bandwidth is read from: a 256 MB float32 tensor, summed."""
    return torch.ones(64 * 1024 * 1024)


def _sum_seconds(big: torch.Tensor) -> float:
    t0 = time.perf_counter()
    big.sum()
    return time.perf_counter() - t0


def _bandwidth_gbs(big: torch.Tensor, seconds: list[float]) -> float:
    return big.numel() * big.element_size() / statistics.median(seconds) / 1e9


@torch.inference_mode()
def floors(linears: list[nn.Module], reps: int = 5) -> dict:
    """What a verification can hardly beat on this machine, measured here: streaming the served
    weights once at the memory bandwidth a 256 MB float32 sum reaches, and one multiply-add per
    weight and row at the rate a 2048^3 float32 matrix product reaches (PyTorch's own GEMM, all
    threads; a practical ceiling rather than a hard one)."""
    big = _sum_buffer()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    sums, mms = [], []
    for _ in range(reps):
        sums.append(_sum_seconds(big))
        t1 = time.perf_counter()
        torch.mm(a, b)
        mms.append(time.perf_counter() - t1)
    bandwidth = _bandwidth_gbs(big, sums)
    gfma = 2048 ** 3 / statistics.median(mms) / 1e9
    weights_mb = sum(_bytes_read(m) for m in linears) / 1e6
    macs = sum(m.in_features * m.out_features for m in linears)
    return {"weights_mb": round(weights_mb, 1), "bandwidth_gbs": round(bandwidth, 1), "memory_ms": round(weights_mb / bandwidth, 2),
            "macs_per_row_m": round(macs / 1e6, 1), "gemm_gfma_s": round(gfma, 1), "fma_ms_per_row": round(macs / gfma / 1e6, 2)}


def floor_ms(floor: dict, nodes: int) -> float:
    """The larger of the two floors for a verification of `nodes` rows."""
    return max(floor["memory_ms"], nodes * floor["fma_ms_per_row"])


def compare_table(result: dict) -> str:
    """`compare`'s figures as text under a line naming the machine and the weights: per tree size,
    packed and stock ms and stock / packed. `result` also holds "hardware" and "weights"."""
    head = (f"{'nodes':>5}  {'verify packed':>13} {'stock':>8} {'x':>5}  {'lm_head packed':>14} {'stock':>8} {'x':>5}  "
            f"{'linears packed':>14} {'floor':>6}")
    lines = [f"{result['hardware']}; {result['weights']}; {result['context']} tokens of context, "
             f"medians of {result['reps']} (ms; x = stock / packed)", head, "-" * len(head)]
    floor = result.get("floor")
    for r in result["rows"]:
        v, h, lin = r["verify_ms"], r["lm_head_ms"], r.get("linears_ms", {})
        lines.append(f"{r['nodes']:>5}  {v['packed']:>13.2f} {v['stock']:>8.2f} {v['stock'] / v['packed']:>5.2f}  "
                     f"{h['packed']:>14.2f} {h['stock']:>8.2f} {h['stock'] / h['packed']:>5.2f}  "
                     f"{lin.get('packed', float('nan')):>14.2f} {floor_ms(floor, r['nodes']) if floor else float('nan'):>6.2f}")
    if floor:
        lines.append(f"floor = max(weights {floor['weights_mb']} MB at {floor['bandwidth_gbs']} GB/s = {floor['memory_ms']} ms, "
                     f"nodes x {floor['macs_per_row_m']} M multiply-adds at {floor['gemm_gfma_s']} GFMA/s = "
                     f"{floor['fma_ms_per_row']} ms per node)")
    return "\n".join(lines)


@torch.inference_mode()
def isa_rows(model: nn.Module, rows: tuple[int, ...], context: int, reps: int, warmup: int = 2) -> dict:
    """Per instruction-set path of the Q8 products this CPU runs (the scalar reference aside):
    median ms of a tree verification of n rows (a chain of n nodes over `context` cached tokens,
    LM head included: the verify phase of a step), per n in `rows`, and r(n) = (t(n) - t(1)) /
    ((n - 1) t(1)), what an extra row costs as a share of a one-row step. Paths and sizes are
    interleaved per round, the paths' order alternating. Beside them, the arithmetic limit: the
    model's multiply-adds per row at the 8-bit rate the path reaches from registers. `model`
    serves Q8 inputs from GGUF blocks; it is left on the path it had."""
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear) and m.q8]
    if not layers:
        return {}
    before = layers[0].isa
    paths = [p for p in extension().isas() if p != "scalar"]
    vocab = model.get_output_embeddings().out_features
    context, cache, g = _prefilled(model, context, max(rows))
    trees = {n: compile_tree(chain_paths(n - 1), f"chain{n}") for n in rows}
    tokens = {n: torch.randint(vocab // 8, vocab, (n,), generator=g) for n in rows}
    times: dict[tuple[str, int], list[float]] = {}
    try:
        for r in range(warmup + reps):
            for n in rows:
                for isa in paths[:: 1 if r % 2 else -1]:
                    set_isa(model, isa)
                    t0 = time.perf_counter()
                    verify.tree_forward(model, cache, trees[n], tokens[n], context)
                    t1 = time.perf_counter()
                    forward.commit(cache, context, [], n)
                    if r >= warmup:
                        times.setdefault((isa, n), []).append((t1 - t0) * 1e3)
    finally:
        set_isa(model, before)
    macs = sum(m.in_features * m.out_features for m in _linears(model, as_served=True))
    out = {"context": context, "reps": reps, "macs_per_row_m": round(macs / 1e6, 1), "paths": {}}
    for isa in paths:
        ms = {n: round(statistics.median(times[(isa, n)]), 3) for n in rows}
        peak = extension().int8_peak(ISA_CODES[isa], 2_000_000)
        out["paths"][isa] = {"ms": ms, "r": {n: round((ms[n] - ms[rows[0]]) / ((n - rows[0]) * ms[rows[0]]), 3) for n in rows[1:]},
                             "int8_gmacs": round(peak / 1e9, 1), "arith_ms_per_row": round(macs / peak * 1e3, 3)}
    return out


def isa_table(result: dict) -> str:
    """`isa_rows` as text: per path, ms by rows and r, and the arithmetic limit of a row."""
    rows = list(next(iter(result["paths"].values()))["ms"])
    head = f"{'path':<12}" + "".join(f"{f'{n} rows':>10}" for n in rows) + "   r at " + " ".join(f"{n:>5}" for n in rows[1:])
    lines = [f"Q8 products by instruction-set path: a verification of n rows (ms), {result['context']} tokens of context, "
             f"medians of {result['reps']}; r = extra-row cost / one-row step", head, "-" * len(head)]
    for isa, p in result["paths"].items():
        lines.append(f"{isa:<12}" + "".join(f"{p['ms'][n]:>10.2f}" for n in rows) + "         " + " ".join(f"{p['r'][n]:>5.2f}" for n in rows[1:]))
    for isa, p in result["paths"].items():
        lines.append(f"arithmetic limit on {isa}: {result['macs_per_row_m']} M multiply-adds a row at {p['int8_gmacs']} G 8-bit "
                     f"multiply-adds/s = {p['arith_ms_per_row']} ms per row")
    return "\n".join(lines)


def chain_bytes(heads) -> tuple[list[int], int]:
    """Per head, the bytes its ResBlocks stream in the chain (values, scales, minimums, biases; of a
    parted linear, `gguf.PartedLinear`, the part on h and each token part's kept outputs), and the
    LM head's (read again at every depth; under heads.json `lm_blocks: q4_1`, its Q4_1 blocks and
    the Q8_0 rows of each call's `LM_REFINE` best)."""
    read = lambda lin: lin.chain_nbytes() if hasattr(lin, "chain_nbytes") else _bytes_read(lin)
    per_head = [sum(read(lin) for b in heads.head_blocks(i) for lin in (b.linear, b.res_connection)
                    if not isinstance(lin, nn.Identity)) for i in range(heads.num_heads)]
    if not heads._lm_packed:
        return per_head, 0
    key = heads._lm_key(0)
    lm = _bytes_read(heads._lm_packed[key])
    fine = getattr(heads, "_lm_fine", {}).get(key)
    if fine is not None:  # (values int8 [K, hidden], scales float16 [K, hidden / 32]): LM_REFINE rows of each, a call
        lm += LM_REFINE * sum(t.shape[1] * t.element_size() for t in fine)
    return per_head, lm


@torch.inference_mode()
def chain_costs(engine, heads, reps: int = 25, context: int = 192, book=None, rule=None) -> dict:
    """The heads' top-1 chain to each depth, in one call as a decode step runs it
    (`calibrate.measure_chain`): cold (right after a base-model step at `context` tokens, which
    pushes the heads' weights out of the nearer caches) and warm (chains back to back); with
    `book`, also cold with the phrasebook asked at every node under `rule` (its reranker), as the
    banks draft. Beside: the bytes a chain to that depth reads (its heads' ResBlocks, the LM head
    once) and streams (the LM head at every depth), and the machine's memory bandwidth (a 256 MB
    float32 sum, as `floors`)."""
    from entmtp.bank.calibrate import forward_between, measure_chain

    between = forward_between(engine, context)
    depth = heads.num_heads
    per_head, lm = chain_bytes(heads)
    big = _sum_buffer()
    big.sum()
    bandwidth = _bandwidth_gbs(big, [_sum_seconds(big) for _ in range(5)])
    del big
    cold = measure_chain(heads, depth, reps=reps, between=between)
    warm = measure_chain(heads, depth, reps=reps)
    booked = measure_chain(heads, depth, reps=reps, book=book, rule=rule, between=between) if book is not None else None
    rows = []
    for d in range(1, depth + 1):
        reads = sum(per_head[:d]) + lm
        rows.append({"depth": d, "cold_ms": round(cold[d], 3), "warm_ms": round(warm[d], 3),
                     "cold_phrasebook_ms": round(booked[d], 3) if booked else None, "reads_mb": round(reads / 1e6, 2),
                     "streams_mb": round((reads + (d - 1) * lm) / 1e6, 2), "cold_gbs": round(reads / (cold[d] * 1e-3) / 1e9, 1)})
    return {"heads": heads.numerics, "draft_vocab": int(heads.draft_vocab.numel()) or heads.vocab_size, "context": context,
            "reps": reps, "bandwidth_gbs": round(bandwidth, 1), "rows": rows}


def chain_table(result: dict) -> str:
    """`chain_costs` as text: per depth, cold and warm ms (and cold with the phrasebook), the bytes
    read and the rate the cold chain reads them at."""
    head = f"{'depth':>5} {'cold':>7} {'warm':>7} {'cold+book':>10} {'reads MB':>9} {'streams MB':>11} {'cold GB/s':>10}"
    lines = [f"The heads' top-1 chain ({result['heads']}, {result['draft_vocab']} draft tokens), one call to each depth: ms cold "
             f"after a base step at {result['context']} tokens, warm, and cold with the phrasebook's reranker at every node "
             f"(+book); medians of {result['reps']}; memory bandwidth here {result['bandwidth_gbs']} GB/s", head, "-" * len(head)]
    for r in result["rows"]:
        book = f"{r['cold_phrasebook_ms']:>10.3f}" if r.get("cold_phrasebook_ms") is not None else f"{'-':>10}"
        lines.append(f"{r['depth']:>5} {r['cold_ms']:>7.3f} {r['warm_ms']:>7.3f} {book} "
                     f"{r['reads_mb']:>9.2f} {r['streams_mb']:>11.2f} {r['cold_gbs']:>10.1f}")
    return "\n".join(lines)
