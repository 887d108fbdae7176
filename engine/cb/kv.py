"""KV costing: bytes per page and the substrate's fixed overhead, a lazily zeroed CPU pool and
attention mask, and the heap a retired batch loop leaves, handed back.

(The recurrent-state pool of hybrid models is priced beside its allocator, in ``state``.)

``pool_budget`` prices KV pages with these numbers before any pool exists, so they follow the
substrate's own sizing rules (``PagedAttentionMemoryHandler``) from the model geometry.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def kv_bytes_per_page(config, *, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of KV one page holds across every attention layer (keys and values), from the model
    geometry; a hybrid's linear-attention layers keep no KV (their state is priced in ``state``)."""
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    from moetray.engine.cb.state import attention_layers

    text = config.get_text_config()
    return (
        2
        * find_num_key_value_heads(text)
        * find_head_dim(text)
        * torch.empty((), dtype=dtype).element_size()
        * page_size
        * len(attention_layers(text))
    )


def kv_overhead_bytes(
    config, *, page_size: int, dtype: torch.dtype, max_batch_tokens: int
) -> tuple[int, int]:
    """(per-page, fixed) bytes the substrate spends beside the KV itself, by its own sizing rules.

    Mirrors ``PagedAttentionMemoryHandler`` for an eager/SDPA model with one full-attention
    group, no async double-buffering and no decode fast path (how :class:`BatchRunner`
    configures it). Per page: the attention-mask columns ``[M, page]`` (priced whole: a batch of
    ``M`` tokens reading the whole cache touches them all, though :func:`map_attention_mask_lazily`
    keeps a lighter load from holding them), the KV read back at the attention peak and the read
    indices. Fixed: two trash pages, the per-batch-token
    activation peak and IO rows, and the mask's ``[M, M]`` square.
    """
    from transformers.generation.continuous_batching.utils import find_head_dim, find_num_key_value_heads

    text = config.get_text_config()
    itemsize = torch.empty((), dtype=dtype).element_size()
    head_dim = find_head_dim(text)
    heads = text.num_attention_heads
    kv_heads = find_num_key_value_heads(text)
    kv_heads_at_peak = 2 * heads + kv_heads  # eager/SDPA repeat K and V to every query head
    m = max_batch_tokens
    per_cache_token = kv_heads_at_peak * head_dim * itemsize + 8  # read-back KV + int64 read index
    per_page = page_size * per_cache_token + m * page_size * itemsize  # + mask columns
    attention_peak = itemsize * (
        text.hidden_size + heads * head_dim + 2 * kv_heads * head_dim + kv_heads_at_peak * head_dim
    )
    io_bytes = 7 * 4 + 4 + 8 + 8
    fixed = (
        2 * kv_bytes_per_page(config, page_size=page_size, dtype=dtype)
        + m * (attention_peak + io_bytes)
        + m * m * itemsize
    )
    return per_page, fixed


@contextmanager
def lazily_zeroed_cpu_cache(device: torch.device) -> Iterator[None]:
    """While the substrate builds its paged cache on the CPU, back it with anonymous memory.

    ``PagedAttentionCache`` allocates its one flat cache tensor with ``torch.zeros``, which on
    the CPU writes every byte up front (a 1 GiB pool: most of a second on a busy machine,
    which is most of a live KV re-split). An anonymous mapping is zero by definition and
    the kernel materialises each page on first touch, so the pool is ready at once and the
    cost moves to the steps that first use each page. Only the cache module's ``torch.zeros``
    for the CPU is affected, only while the cache is being built (no other batch loop runs
    then), and the real module is restored on exit. Off the CPU (CUDA memsets are fast) this
    does nothing.
    """
    if torch.device(device).type != "cpu":
        yield
        return
    from transformers.generation.continuous_batching import cache as cache_module

    real = cache_module.torch

    class _ZeroMappedTorch:
        def __getattr__(self, name: str):
            return getattr(real, name)

        @staticmethod
        def zeros(size, *, dtype, device):
            if (
                dtype is real.uint8
                and real.device(device).type == "cpu"
                and isinstance(size, int)
                and size > 0
            ):
                return zero_mapped(size)
            return real.zeros(size, dtype=dtype, device=device)

    cache_module.torch = _ZeroMappedTorch()  # type: ignore[assignment]  # the substrate's module, patched for this block
    try:
        yield
    finally:
        cache_module.torch = real


def zero_mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes (``uint8``) in an anonymous mapping: a page is resident once written."""
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def map_attention_mask_lazily(processor) -> None:  # noqa: ANN001 - the substrate's ContinuousBatchProcessor
    """Back the substrate's CPU attention mask with a fresh anonymous mapping, and have full resets
    leave it alone: the mask then holds only the pages steps have read.

    The mask is ``[max batch tokens, whole cache + max batch tokens]`` (the demo's Q8_0 file, default
    KV size: 79 MiB of bfloat16), and a full reset (at construction, and again when the generation
    loop adopts the warm-up's processor) fills all of it with the minimum: every page resident from
    the start. No step reads that fill: ``prepare_batch_tensors`` first resets the rectangle the
    step reads (``[:q, :q + kv]``, at the new batch's sizes), then builds its blocks in it. Served
    RSS, that file, one engine: 987 → 914 MiB."""
    io = processor.inputs_and_outputs
    masks = getattr(io, "attention_mask", None)
    if not isinstance(masks, dict) or io.device.type != "cpu":
        return
    for layer_type, mask in masks.items():
        nbytes = mask.numel() * mask.element_size()
        masks[layer_type] = zero_mapped(nbytes).view(mask.dtype).view(mask.shape)
    reset = type(io)._reset_static_tensors

    def reset_sparing_the_mask(full_reset: bool = False) -> None:
        reset(_WithoutMask(io) if full_reset else io, full_reset=full_reset)

    io._reset_static_tensors = reset_sparing_the_mask


class _WithoutMask:
    """``io`` as the substrate's reset sees it with no attention mask (a model without one): every
    other attribute is read from and written to ``io`` itself, whose mask stays in place for any
    other reader."""

    def __init__(self, io) -> None:  # noqa: ANN001 - the substrate's ContinuousBatchingIOs
        object.__setattr__(self, "_io", io)

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever the attribute is
        return None if name == "attention_mask" else getattr(self._io, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._io, name, value)


def return_freed_heap() -> None:
    """Hand freed heap memory back to the kernel (glibc's ``malloc_trim``); elsewhere, nothing.

    A stopped batch loop frees its buffers (the KV pool itself is an anonymous mapping and is
    unmapped at once), but glibc keeps freed heap for reuse, and once an mmapped buffer is
    freed it raises its mmap threshold, so later buffers of that size land on the heap too:
    each KV re-split used to leave a few MiB of RSS behind (``moetray bench soak``). Costs
    about a millisecond.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
