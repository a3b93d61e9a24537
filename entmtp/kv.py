"""Commit the accepted path in the KV cache: keep its entries, contiguous, drop the rest."""

from __future__ import annotations

import torch


def commit(cache, past: int, accepted: list[int], n_tree: int) -> None:
    """After a tree forward the cache holds past + n_tree entries; keep past + accepted nodes.

    transformers has no sequence-select API, so per layer the accepted entries are gathered and
    copied in place to positions past..past+L-1, then the tail is cropped.
    """
    n_keep = len(accepted)
    if accepted != list(range(n_keep)):  # a chain prefix needs no copy, only the crop
        src = torch.tensor(accepted, device=cache.layers[0].keys.device) + past
        for layer in cache.layers:
            if src.device != layer.keys.device:
                src = src.to(layer.keys.device)
            layer.keys[..., past : past + n_keep, :] = layer.keys.index_select(-2, src)
            layer.values[..., past : past + n_keep, :] = layer.values.index_select(-2, src)
    drop = n_tree - n_keep
    if drop:
        for layer in cache.layers:
            layer.crop(-drop)
