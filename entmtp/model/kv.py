"""The decode loop's KV cache: preallocated per layer, and commit of the accepted path."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import DynamicLayer

from entmtp.model import ext


def _lazy_view(name: str) -> property:
    """A `BufferedLayer` attribute read through `_fresh` (the views are remade when stale)."""

    def get(self):
        self._fresh()
        return getattr(self, name)

    return property(get, lambda self, value: setattr(self, name, value))


class BufferedLayer(DynamicLayer):
    """A `DynamicLayer` that writes new entries into a preallocated buffer instead of `torch.cat`.

    `keys`/`values` are views of the first `length` positions (made when next read after a
    change), so a step appends its block in place (the stock layer copies the whole cache every
    step), `crop` only shortens the views, and `commit` moves the accepted entries inside the
    buffer. Capacity doubles when full.
    """

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.length = 0
        self._k = self._v = None
        self.is_initialized = True

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, need: int) -> None:
        if self._k is not None and need <= self._k.shape[-2]:
            return
        cap = max(256, need, 2 * (0 if self._k is None else self._k.shape[-2]))
        k = key_states.new_empty(*key_states.shape[:-2], cap, key_states.shape[-1])
        v = value_states.new_empty(*value_states.shape[:-2], cap, value_states.shape[-1])
        if self.length:
            k[..., : self.length, :] = self._k[..., : self.length, :]
            v[..., : self.length, :] = self._v[..., : self.length, :]
        self._k, self._v = k, v

    _stale = False  # `keys`/`values` are made on first read after a change: a step changes 30 layers

    def _views(self) -> None:
        self._stale = True

    def _fresh(self) -> None:
        if self._stale:
            self._stale = False
            self._keys, self._values = self._k[..., : self.length, :], self._v[..., : self.length, :]

    keys = _lazy_view("_keys")
    values = _lazy_view("_values")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self._reserve(key_states, value_states, self.length + n)
        self._k[..., self.length : self.length + n, :] = key_states
        self._v[..., self.length : self.length + n, :] = value_states
        self.length += n
        self._views()
        return self.keys, self.values

    def make_room(self, n: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers [1, kv_heads, capacity, dim], grown to hold n more entries, for
        a kernel that writes them in place (then `advance(n)`)."""
        if not self.is_initialized or self._k is None or self.length + n > self._k.shape[-2]:  # only then: a step's hot path
            empty = torch.empty(1, kv_heads, 0, dim, dtype=dtype, device=device)  # the shape templates `_reserve` reads
            if not self.is_initialized:
                self.lazy_initialization(empty, empty)
            self._reserve(empty, empty, self.length + n)
        return self._k, self._v

    def advance(self, n: int) -> None:
        self.length += n
        self._views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count: the number of entries to drop")
        if tokens_to_remove and self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized and self._k is not None:
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the decode loop runs batch 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the decode loop runs batch 1")


def new_cache(config):
    """A `DynamicCache` whose full-attention layers are `BufferedLayer`s (sliding ones stay stock)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    cache.layers = [BufferedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def commit(cache, past: int, accepted: list[int], n_tree: int) -> None:
    """After a tree forward the dynamic cache holds past + n_tree entries; keep past + accepted nodes.

    transformers has no sequence-select API, so per layer the accepted entries are gathered and
    copied in place to positions past..past+L-1, then the tail is cropped.
    """
    n_keep = len(accepted)
    if accepted != list(range(n_keep)) and not _keep_in_place(cache, past, accepted):  # a chain prefix needs only the crop
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


def _keep_in_place(cache, past: int, accepted: list[int]) -> bool:
    """`commit`'s moves in one extension call (`keep_entries`) where the extension is loaded and
    every layer is a CPU `BufferedLayer` (the 120 small tensor operations it replaces took ~0.8 ms
    a step on the 2-core AMD EPYC). False where it does not apply: the caller moves them itself."""
    built, layers = ext.loaded(), cache.layers
    if built is None or not all(type(layer) is BufferedLayer and getattr(layer, "_k", None) is not None
                              and layer._k.device.type == "cpu" for layer in layers):
        return False
    built.keep_entries([b for layer in layers for b in (layer._k, layer._v)], past, accepted)
    return True


@functools.lru_cache(maxsize=None)
def _cache_kwarg(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_arg(module: torch.nn.Module, cache) -> dict:
    """The cache as a keyword for `module`'s forward: `cache` in current transformers,
    `past_key_values` in releases before 5.20 (which would silently drop an unknown `cache=`)."""
    return {_cache_kwarg(type(module)): cache}
