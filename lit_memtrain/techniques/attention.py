"""``attn_implementation="sdpa_by_document"``: PyTorch SDPA run one packed document at a time.

Why: for a padding-free row (several documents, ``position_ids`` restarting at each), transformers keeps
``sdpa`` documents apart by building a dense L x L mask: O(L^2) memory (16 GiB of booleans for one
128k-token row), a kernel that computes every cross-document block only to mask it out, and on GPUs a
fallback away from SDPA's flash backend, which takes no mask. Flash-attention's varlen kernels avoid all
three but need the ``flash-attn`` package, which does not build everywhere. This implementation calls SDPA with
``is_causal=True`` once per document, so memory is O(L), cross-document blocks cost nothing, and SDPA may
pick its flash or memory-efficient kernel.

Where the documents are: transformers builds one mask per forward (``create_causal_mask``) and hands it to
every layer. For this implementation that "mask" is, for packed rows, the document index of each token
(int32, [B, 1, 1, L]: O(L)), found by probing the mask function transformers composed (a token that cannot
see the one before it starts a document); for unpacked rows it is ``None``. When ``cu_seq_lens_q`` is
passed (``CausalLMModule`` passes the collator's, kept on the host: no read-back from the device) the layers read
the bounds from it rather than from the device, saving a sync per layer.

Only plain causal attention is split by document. Anything else gets transformers' sdpa mask and is handed
to transformers' own ``sdpa`` unchanged: padded batches, generation with a KV cache, sliding-window,
chunked, bidirectional or prefix (blockwise) attention, custom mask functions, and callers that ask for a
materialised mask. Models that need extra attention arguments (``softcap``, attention sinks) are refused, on
every path (transformers' sdpa would drop the sinks silently).
Registered with transformers when ``lit_memtrain`` is imported.

``attn_implementation="varlen_by_document"`` is the same with one kernel per row on CUDA: torch's
``torch.nn.attention.varlen.varlen_attn`` (a flash kernel taking every document's bounds) computes all the
documents of a packed row at once, where the per-document loop launches one SDPA per document. It needs
CUDA, fp16/bf16 inputs (as under ``bf16-mixed``), head_dim <= 256 and no dropout; anything else takes the
per-document SDPA path. :func:`choose_document_attention` picks the fastest of these for a device; it is
what ``CausalLMModule`` uses when no attention implementation is named.

Usage::

    import lit_memtrain  # registers the implementation

    module = CausalLMModule(model="Qwen/Qwen3-0.6B", attn_implementation="sdpa_by_document")
    data = SFTDataModule(..., packing=True)
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SDPA_BY_DOCUMENT = "sdpa_by_document"
VARLEN_BY_DOCUMENT = "varlen_by_document"

_UNSUPPORTED_KWARGS = ("softcap", "s_aux")


def sdpa_by_document(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    varlen: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Causal attention within each document of each row; ``query`` is [B, heads, L, head_dim]. With ``varlen``
    (:data:`varlen_by_document`), every document of a row goes through one ``varlen_attn`` call where it can run."""
    # Checked before any call goes to transformers' sdpa (padded rows, sliding windows...), which drops attention
    # sinks (``s_aux``) without a word: a model with sinks that supports no sdpa (GPT-OSS) still takes
    # ``varlen_by_document``, whose name transformers does not check, and its padded batches lost their sinks.
    unsupported = [name for name in _UNSUPPORTED_KWARGS if kwargs.get(name) is not None]
    if unsupported:
        name = VARLEN_BY_DOCUMENT if varlen else SDPA_BY_DOCUMENT
        raise ValueError(
            f"attn_implementation={name!r} does not support {', '.join(unsupported)} (set by "
            f"{type(module).__name__}); use 'eager' or a flash-attention kernel for this model."
        )
    document_ids = attention_mask if _is_document_ids(attention_mask, query) else None
    causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    if (attention_mask is not None and document_ids is None) or query.shape[2] != key.shape[2] or not causal:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    bounds = _document_bounds(query, document_ids, kwargs.get("cu_seq_lens_q"))
    if all(len(row_bounds) == 2 for row_bounds in bounds):  # one document per row: one call for the batch
        output = _causal_sdpa(query, key, value, scaling, dropout)
    else:
        attend = _varlen_row if varlen and _varlen_runs(query, dropout) else _attend_row
        rows = [attend(query, key, value, row, row_bounds, scaling, dropout) for row, row_bounds in enumerate(bounds)]
        # One row (every padding-free batch) is not copied by a cat: varlen's [L, heads, head_dim] output then needs
        # no copy below either, and the output the kernel saves for backward is the one the next layer reads (a cat
        # and a contiguous copy of it cost 2 x 64 MiB per layer at 16k tokens on Qwen3-0.6B, one of them kept).
        output = rows[0] if len(rows) == 1 else torch.cat(rows)
    return output.transpose(1, 2).contiguous(), None


def _find_varlen_kernel() -> tuple[Callable[..., Tensor], dict[str, Any], bool] | None:
    """torch's ``varlen_attn`` (``torch.nn.attention.varlen``), with the keyword that makes it causal and whether
    it takes grouped key/value heads; ``None`` in a torch without it. Its signature has changed between
    releases (an ``is_causal`` flag, then a ``window_size`` where ``(-1, 0)`` is causal)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in parameters:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in parameters


_VARLEN_KERNEL = _find_varlen_kernel()


def varlen_repeats_key_value_heads() -> bool:
    """Whether :data:`varlen_by_document` repeats a grouped-query model's key and value heads to the query's
    count before torch's ``varlen_attn``: where this torch's ``varlen_attn`` takes no ``enable_gqa`` (torch 2.11's
    has none). Then each layer keeps the repeated key and value for the backward, ``query_heads / key_value_heads``
    times their size: what the planner simulates too."""
    return _VARLEN_KERNEL is not None and not _VARLEN_KERNEL[2]


def _varlen_runs(query: Tensor, dropout: float) -> bool:
    """``varlen_attn`` is a flash kernel: CUDA, fp16 or bf16, head_dim up to 256, no dropout."""
    return (
        _VARLEN_KERNEL is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and query.shape[-1] <= 256
        and dropout == 0
    )


def _varlen_row(
    query: Tensor, key: Tensor, value: Tensor, row: int, bounds: list[int], scaling: float | None, dropout: float
) -> Tensor:
    """Row ``row`` of the output, all its documents in one ``varlen_attn`` call; [1, heads, L, head_dim]."""
    kernel, causal, takes_groups = _VARLEN_KERNEL
    query_rows, key_rows, value_rows = (t[row].transpose(0, 1).contiguous() for t in (query, key, value))
    groups = query_rows.shape[1] // key_rows.shape[1]
    if groups > 1 and not takes_groups:
        key_rows, value_rows = key_rows.repeat_interleave(groups, dim=1), value_rows.repeat_interleave(groups, dim=1)
    extra = {"enable_gqa": True} if groups > 1 and takes_groups else {}
    starts, longest = _varlen_documents(tuple(bounds), query.device)
    output = kernel(
        query_rows, key_rows, value_rows, starts, starts, longest, longest, scale=scaling, **causal, **extra
    )
    return output.transpose(0, 1).unsqueeze(0)


@functools.lru_cache(maxsize=8)
def _varlen_documents(bounds: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    """The kernel's document starts on ``device`` (empty documents left out) and the longest document, made once
    per row of documents rather than once per layer (every layer of a forward reads the same bounds):
    ``torch.tensor(bounds, device=cuda)`` copies from pageable host memory and waits for the device to finish
    all its queued work, a sync in every layer's forward that kept the host from running ahead of the GPU. From
    pinned memory the copy is queued without waiting. Read-only for the kernel, so every layer shares it."""
    kept = [bound for index, bound in enumerate(bounds) if index == 0 or bound != bounds[index - 1]]  # no empty ones
    host = torch.tensor(kept, dtype=torch.int32)
    starts = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return starts, max(stop - start for start, stop in pairwise(kept))


def _attend_row(
    query: Tensor, key: Tensor, value: Tensor, row: int, bounds: list[int], scaling: float | None, dropout: float
) -> Tensor:
    """Row ``row`` of the output, each document attending causally to itself only."""
    documents = [
        _causal_sdpa(
            query[row : row + 1, :, start:stop],
            key[row : row + 1, :, start:stop],
            value[row : row + 1, :, start:stop],
            scaling,
            dropout,
        )
        for start, stop in pairwise(bounds)
        if stop > start
    ]
    return torch.cat(documents, dim=2)


def _causal_sdpa(query: Tensor, key: Tensor, value: Tensor, scaling: float | None, dropout: float) -> Tensor:
    """SDPA's fused kernels take grouped key/value heads (``enable_gqa``) up to head_dim 256 only; beyond
    that, repeating the heads keeps them off the O(L^2)-memory math kernel."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and not key.shape[-1] == value.shape[-1] <= 256:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        dropout_p=dropout,
        is_causal=True,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def cu_seq_lens_bounds(cu_seq_lens: Tensor, rows: int, length: int) -> list[int]:
    """The document bounds of one flattened row, read from a padding-free batch's ``cu_seq_lens_q``, checked.

    ``cu_seq_lens_q`` (as :class:`~lit_memtrain.datamodules.padding_free.PaddingFreeCollator` builds it) holds
    the start of every document of a single row, then the row's length. Read wrong, documents would attend to
    each other or be cut, silently; so whoever reads the bounds (this module's attention, the context-parallel
    sharding) checks them here.

    Args:
        cu_seq_lens: the document starts and the row length (read with one ``tolist``: keep it on the CPU).
        rows: rows of the batch it came with (must be 1).
        length: tokens of that row.

    Returns:
        The bounds as a list: non-decreasing, from 0 to ``length``.

    Raises:
        ValueError: the bounds do not rise from 0 to ``length``, or the batch has several rows.
    """
    bounds = tuple(cu_seq_lens.tolist())
    _check_bounds(bounds, rows, length)
    return list(bounds)


@functools.lru_cache(maxsize=8)
def _check_bounds(bounds: tuple[int, ...], rows: int, length: int) -> None:
    """Raise unless ``bounds`` rise from 0 to ``length`` over one row. Remembered by value: every layer of a
    forward reads the same row's bounds, checked once rather than once per layer (a failed check is not
    remembered, and raises again)."""
    if rows != 1 or bounds[0] != 0 or bounds[-1] != length or any(b < a for a, b in pairwise(bounds)):
        raise ValueError(
            f"cu_seq_lens_q must rise from 0 to {length} over one flattened row of {length} tokens, got "
            f"{list(bounds[:4])}...{list(bounds[-1:])} for a batch of {rows} row(s); build padding-free batches "
            "with PaddingFreeCollator."
        )


def _document_bounds(query: Tensor, document_ids: Tensor | None, cu_seq_lens: Tensor | None) -> list[list[int]]:
    """Per row, the token offsets where its documents start, followed by the row length."""
    batch, length = query.shape[0], query.shape[2]
    if cu_seq_lens is not None:
        return [cu_seq_lens_bounds(cu_seq_lens, batch, length)]
    if document_ids is None:
        return [[0, length]] * batch
    ids = document_ids.reshape(batch, length)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    bounds: list[list[int]] = [[] for _ in range(batch)]
    for row, start in torch.nonzero(starts).tolist():
        bounds[row].append(start)
    return [row + [length] for row in bounds]


def _is_document_ids(attention_mask: Tensor | None, query: Tensor) -> bool:
    """Whether ``attention_mask`` is what ``_mask_or_document_ids`` returns for packed rows (a real mask is
    bool or float, with a query dimension)."""
    return (
        attention_mask is not None
        and attention_mask.dtype == torch.int32
        and attention_mask.shape == (query.shape[0], 1, 1, query.shape[2])
    )


def _mask_or_document_ids(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """The "mask" ``sdpa_by_document`` gets: ``None`` for plain causal rows, the document index of each token
    for packed rows, and transformers' sdpa mask for anything else (padding, a KV cache, sliding windows,
    chunked, bidirectional or blockwise attention, custom mask functions, callers that need a materialised
    mask). Arguments this cannot recognise also get the sdpa mask, which is always correct."""
    if not _causal_over_whole_rows(attention_mask, kwargs):
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    batch, length = kwargs["batch_size"], kwargs["q_length"]
    rows = torch.arange(batch, device=kwargs.get("device"))[:, None]
    positions = torch.arange(length - 1, device=kwargs.get("device"))[None, :]
    mask_function = kwargs["mask_function"]
    sees_next = torch.as_tensor(mask_function(rows, 0, positions, positions + 1))
    sees_previous = torch.as_tensor(mask_function(rows, 0, positions + 1, positions)).expand(batch, length - 1)
    if sees_next.any():  # a blockwise (prefix) overlay: not causal
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)
    if sees_previous.all():  # one document per row
        if kwargs.get("allow_is_causal_skip", True):
            return None
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)  # the caller asked for a real mask
    starts = torch.ones(batch, length, dtype=torch.int32, device=sees_previous.device)
    starts[:, 1:] = (~sees_previous).int()
    return starts.cumsum(dim=1, dtype=torch.int32).view(batch, 1, 1, length)


def _causal_over_whole_rows(attention_mask: Tensor | None, kwargs: dict[str, Any]) -> bool:
    """No padding, no cache offset, no window, no custom (vmap) or bidirectional mask: causal attention of
    every token of every row, perhaps cut into documents."""
    return (
        attention_mask is None
        and kwargs.get("local_size") is None
        and not kwargs.get("use_vmap", False)
        and "allow_is_bidirectional_skip" not in kwargs
        and "mask_function" in kwargs
        and "batch_size" in kwargs
        and kwargs.get("q_length", 0) > 1
        and kwargs["q_length"] == kwargs.get("kv_length")
        and not kwargs.get("q_offset")
        and not kwargs.get("kv_offset")
    )


FLASH_ATTN_MAX_HEAD_DIM = 256  # flash-attn 2's kernels stop at head dimension 256


def _flash_attn_installed() -> bool:
    # Looked up at each call (no import, no cache): tests and environments change what is installed.
    return importlib.util.find_spec("flash_attn") is not None


def check_flash_attn(value: str | None, argument: str = "attn_implementation", alternative: str = "sdpa") -> None:
    """Raise ``ValueError`` when ``value`` names flash-attn's kernels and the flash-attn package is not installed.

    Why up front: transformers (and our context-parallel attention) import flash-attn only at the first
    forward, on every rank, after the model is built; checking where the setting is read makes a config fail
    when it is parsed, naming the extra to install or the kernel to use instead. Every place that takes a
    flash-attn kernel by name calls this (``CausalLMModule``'s ``attn_implementation``, Ulysses' ``inner``).

    Args:
        value: the kernel asked for; names starting with ``flash_attention`` need the package.
        argument: the setting's name, for the message.
        alternative: the value to suggest instead.

    Example:
        >>> check_flash_attn("sdpa_by_document")  # not a flash-attn kernel: nothing to check
    """
    if value is not None and value.startswith("flash_attention") and not _flash_attn_installed():
        raise ValueError(
            f"{argument}={value!r} needs the flash-attn package (CUDA only), which is not installed: pip install "
            f"'lit-memtrain[flash]', or use {argument}={alternative!r}."
        )


def attention_head_dim(config: Any) -> int:
    """The head dimension of a transformers config: ``head_dim`` where the model sets it, else hidden / heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def choose_document_attention(model: torch.nn.Module, device: torch.device, half_precision: bool) -> str:
    """The fastest attention implementation that keeps packed documents apart for ``model`` on ``device``.

    On CUDA: flash-attn's varlen kernel (``flash_attention_2``, reading the collator's ``cu_seq_lens``) when the
    package is installed, the model supports it, its heads have at most 256 dimensions and attention runs in
    fp16/bf16 (``half_precision``: half weights or mixed precision; flash-attn refuses fp32), else
    :func:`varlen_by_document` (torch's ``varlen_attn``, which itself falls back to per-document SDPA for fp32)
    when this torch has it; elsewhere
    (and as the fallback) ``sdpa_by_document``. A model without SDPA support (Gemma 2's attention softcap,
    GPT-OSS's sinks) keeps ``eager``. Whichever is chosen, the module's packed-row probe checks at setup that
    packed documents stay apart (eager does not for every model, and a model's non-attention layers can carry state
    from one document into the next whatever the attention).
    """
    if not getattr(model, "_supports_sdpa", False):
        return "eager"
    if device.type == "cuda":
        flash_attn = _flash_attn_installed()
        fits_flash = attention_head_dim(model.config) <= FLASH_ATTN_MAX_HEAD_DIM
        if half_precision and flash_attn and fits_flash and getattr(model, "_supports_flash_attn", False):
            return "flash_attention_2"
        if _VARLEN_KERNEL is not None:
            return VARLEN_BY_DOCUMENT
    return SDPA_BY_DOCUMENT


varlen_by_document = functools.partial(sdpa_by_document, varlen=True)

# Graph capture (torch.compile, CompiledLayers) runs them eagerly: they read the documents' bounds on the host,
# which a captured graph would specialise on, compiling again for every new packing.
AttentionInterface.register(SDPA_BY_DOCUMENT, torch.compiler.disable(sdpa_by_document))
AttentionMaskInterface.register(SDPA_BY_DOCUMENT, _mask_or_document_ids)
AttentionInterface.register(VARLEN_BY_DOCUMENT, torch.compiler.disable(varlen_by_document))
AttentionMaskInterface.register(VARLEN_BY_DOCUMENT, _mask_or_document_ids)
