"""Cut one batch along the sequence for the ranks of a context-parallel group.

Why each step is where it is:

- *Targets are shifted on the whole row first* (``targets[t] = labels[t + 1]``, ``-100`` at the last position).
  Shifting each shard on its own would lose the target of every shard's last token, and with head-tail order
  one token of each rank would be trained on the first token of a chunk that is not its successor.
- *The row is padded* to the length the method needs: a multiple of ``cp`` for Ulysses (equal shards), of
  ``2 * cp`` for ring (head-tail chunks). The padding is its own segment (positions from 0, targets ``-100``,
  listed in the document bounds), so no real token attends to it and it never trains.
- *Ulysses shards are contiguous*: after the all-to-all every rank holds the whole sequence for some heads, so
  the work per rank is equal whatever the order. *Ring shards are head-tail*: rank ``r`` holds chunks ``r`` and
  ``2 * cp - 1 - r`` of ``2 * cp``, so under a causal mask every rank has the same amount of attention to do
  (contiguous shards would leave the last rank with most of it). This is the order torch's ``context_parallel``
  uses, which :mod:`lit_memtrain.parallel.context_parallel.torch_ring` checks at run time.
- *Positions and document bounds stay global*: each rank's ``position_ids`` are the row's own (RoPE and YaRN
  then rotate every token exactly as on one process), and the document bounds of the whole row go to attention
  in the :class:`ShardLayout`. A shard's local positions cannot stand for them: with head-tail order they read
  like two documents (``[0..7, 24..31]``).
- *Counts are local*: ``num_tokens`` counts this shard's tokens only, and its ``shift_labels`` hold only its own
  targets, so summing either over all ranks counts each token once (counting the whole row on each rank would
  count it ``cp`` times).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lit_memtrain.datamodules.batch import CU_SEQ_LENS_ON_HOST, IGNORE_INDEX, shift_targets
from lit_memtrain.parallel.context_parallel.validation import METHODS
from lit_memtrain.techniques.attention import cu_seq_lens_bounds

__all__ = ["SequenceShard", "ShardLayout", "check_same_rows", "padded_length", "rank_chunks", "shard_batch"]

# Keys cut or rebuilt per shard, or dropped (CU_SEQ_LENS_ON_HOST: the whole row's bounds; a shard's are in its layout).
_UNSHARDED_KEYS = frozenset(
    {"input_ids", "labels", "position_ids", "attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
     "max_length_k", "num_trainable_tokens", "num_tokens", "seq_lengths", CU_SEQ_LENS_ON_HOST}
)  # fmt: skip


def padded_length(length: int, cp_size: int, method: str) -> int:
    """The row length ``method`` needs: a multiple of ``cp_size`` (Ulysses) or ``2 * cp_size`` (ring)."""
    multiple = 1 if cp_size == 1 else cp_size * (2 if method == "ring" else 1)
    return -(-length // multiple) * multiple


def rank_chunks(length: int, cp_size: int, method: str, cp_rank: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, stop)`` token ranges of a padded row that ``cp_rank`` holds, in the order it holds them."""
    if cp_size == 1:
        return ((0, length),)
    if method == "ring":
        chunk = length // (2 * cp_size)
        tail = 2 * cp_size - 1 - cp_rank
        return ((cp_rank * chunk, (cp_rank + 1) * chunk), (tail * chunk, (tail + 1) * chunk))
    shard = length // cp_size
    return ((cp_rank * shard, (cp_rank + 1) * shard),)


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """What attention needs to know about a sharded row besides its own queries, keys and values.

    Attributes:
        method: ``"ulysses"`` or ``"ring"``.
        cp_rank: this rank's index in the context-parallel group.
        cp_size: ranks in the group.
        batch_size: rows in the batch (1 for a padding-free row of several documents).
        length: tokens per row after padding; the sequence attention covers across the group.
        padding: tokens appended to each row (0 when the length already fitted).
        cu_seq_lens: int32 CPU tensor, the start of every segment of a row (documents, then the padding when
            some was added) followed by ``length``. Every row of the batch has these segments.
        num_documents: segments of the row as given, before the padding.
        chunks: the ``[start, stop)`` ranges of the row this rank holds, in local order.
        position_ids: ``[B, local tokens]``, the positions this rank's tokens have in their documents: what
            the model must be called with (the installed attention checks it once per batch).
    """

    method: str
    cp_rank: int
    cp_size: int
    batch_size: int
    length: int
    padding: int
    cu_seq_lens: Tensor
    num_documents: int
    chunks: tuple[tuple[int, int], ...]
    position_ids: Tensor

    @property
    def local_length(self) -> int:
        """Tokens of a row this rank holds."""
        return sum(stop - start for start, stop in self.chunks)

    @property
    def max_segment_length(self) -> int:
        """The longest segment of a row (``max_length_q`` for flash-attention's varlen kernels)."""
        return int((self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).max())

    def gathered_order(self) -> list[tuple[int, int]]:
        """Slices of the rank-major concatenation of every rank's tokens that, concatenated, give the row in order."""
        offset, pieces = 0, []
        for rank in range(self.cp_size):
            for start, stop in rank_chunks(self.length, self.cp_size, self.method, rank):
                pieces.append((start, offset, offset + stop - start))
                offset += stop - start
        return [(begin, end) for _, begin, end in sorted(pieces)]


@dataclass(frozen=True)
class SequenceShard:
    """One rank's part of a batch (``batch``) and what attention needs to know about the whole row (``layout``).

    ``batch`` holds ``input_ids`` and ``position_ids`` ([B, local length], global positions), ``shift_labels``
    (targets already aligned with each position: do not shift them again) and ``num_tokens`` (int, this
    shard's tokens that are neither padding added here nor the collator's), plus the input batch's entries that
    are not per token (passed on unchanged). A whole-row count a collator of 0.1 wrote (``num_trainable_tokens``)
    is dropped: it is not this shard's.
    """

    batch: dict[str, Any]
    layout: ShardLayout


def _document_bounds(batch: dict[str, Any], length: int) -> list[int]:
    """Segment starts of a row, then ``length``; every row of the batch must have the same segments."""
    rows = batch["input_ids"].shape[0]
    from_positions = None
    if batch.get("position_ids") is not None:
        positions = batch["position_ids"].expand(rows, -1)
        restarts = torch.ones_like(positions, dtype=torch.bool)
        restarts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        if rows > 1 and restarts[:, 1:].any():
            raise ValueError(
                f"Row(s) of a batch of {rows} hold several documents (position_ids restart inside a row). Context "
                "parallelism takes such rows one at a time: collate packed documents into one flattened row "
                "(PaddingFreeCollator)."
            )
        from_positions = restarts[0].nonzero().squeeze(1).tolist() + [length]
    if batch.get("cu_seq_lens_q") is None:
        return from_positions or [0, length]
    bounds = cu_seq_lens_bounds(batch["cu_seq_lens_q"], rows, length)
    if from_positions is not None and sorted(set(bounds)) != from_positions:
        raise ValueError(
            f"cu_seq_lens_q {bounds[:6]}... and the restarts of position_ids {from_positions[:6]}... disagree on "
            "where the documents are; build both with one collator (PaddingFreeCollator)."
        )
    return bounds


def _check_inputs(batch: dict[str, Any], cp_rank: int, cp_size: int, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(map(repr, METHODS))}, got {method!r}.")
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive int, got {cp_size!r}.")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}.")
    for key in ("input_ids", "labels"):
        value = batch.get(key)
        if not isinstance(value, Tensor) or value.dim() != 2:
            found = "missing" if value is None else f"{type(value).__name__} {tuple(getattr(value, 'shape', ()))}"
            raise ValueError(f"A context-parallel batch needs {key!r} as a [batch, length] tensor, got {found}.")
    if batch["labels"].shape != batch["input_ids"].shape:
        raise ValueError(
            f"labels {tuple(batch['labels'].shape)} and input_ids {tuple(batch['input_ids'].shape)} differ in shape."
        )
    length = batch["input_ids"].shape[1]
    per_token = [
        key
        for key, value in batch.items()
        if key not in _UNSHARDED_KEYS and isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == length
    ]
    if per_token:
        raise ValueError(
            f"Batch entries {per_token} look per-token ([batch, {length}, ...]) and shard_batch does not know how to "
            "cut or pad them; drop them from the batch or extend shard_batch."
        )
    mask = batch.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(
            "The batch has padding marked by attention_mask; context parallelism takes rows without a padding mask "
            "(each rank would see only part of it). Use padding-free batches (PaddingFreeCollator): documents are "
            "kept apart by their bounds and the row is padded here as needed."
        )


def shard_batch(
    batch: dict[str, Any], cp_rank: int, cp_size: int, method: str, pad_token_id: int = 0
) -> SequenceShard:
    """This rank's part of ``batch`` along the sequence, for ``method`` over ``cp_size`` ranks.

    Args:
        batch: ``input_ids`` and ``labels`` ([B, L], unshifted), optionally ``position_ids`` ([B or 1, L];
            ``0..L-1`` when absent), ``cu_seq_lens_q`` (document starts of one flattened row, as
            :class:`~lit_memtrain.datamodules.padding_free.PaddingFreeCollator` builds them), ``num_tokens``
            (real tokens; the rest of the row is the collator's padding) and an ``attention_mask`` of ones
            (dropped). Several documents in one row need ``B == 1``.
        cp_rank: this rank's index in its context-parallel group.
        cp_size: ranks in the group.
        method: ``"ulysses"`` (contiguous shards) or ``"ring"`` (head-tail shards).
        pad_token_id: input id written into the padding this adds.

    Returns:
        The shard (its ``batch`` is what the model and the loss take on this rank) and its layout (what the
        attention installed by :func:`~lit_memtrain.parallel.context_parallel.install_attention` needs for this batch).

    Example:
        >>> batch = {"input_ids": torch.arange(10)[None], "labels": torch.arange(10)[None]}
        >>> shard = shard_batch(batch, cp_rank=1, cp_size=2, method="ring")  # padded to 12, chunks of 3
        >>> shard.batch["position_ids"].tolist(), shard.batch["shift_labels"].tolist(), shard.layout.padding
        ([[3, 4, 5, 6, 7, 8]], [[4, 5, 6, 7, 8, 9]], 2)
    """
    _check_inputs(batch, cp_rank, cp_size, method)
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows, length = input_ids.shape
    bounds = _document_bounds(batch, length)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length, device=input_ids.device)[None]
    positions = positions.expand(rows, -1)
    targets = shift_targets(labels)

    padded = padded_length(length, cp_size, method)
    padding = padded - length
    if padding:
        input_ids = F.pad(input_ids, (0, padding), value=pad_token_id)
        targets = F.pad(targets, (0, padding), value=IGNORE_INDEX)
        positions = torch.cat([positions, torch.arange(padding, device=positions.device).expand(rows, -1)], dim=1)
    chunks = rank_chunks(padded, cp_size, method, cp_rank)

    def local(tensor: Tensor) -> Tensor:
        return torch.cat([tensor[:, start:stop] for start, stop in chunks], dim=1)

    layout = ShardLayout(
        method=method,
        cp_rank=cp_rank,
        cp_size=cp_size,
        batch_size=rows,
        length=padded,
        padding=padding,
        cu_seq_lens=torch.tensor(bounds + ([padded] if padding else []), dtype=torch.int32),
        num_documents=len(bounds) - 1,
        chunks=chunks,
        position_ids=local(positions),
    )

    real_length = int(batch["num_tokens"]) if rows == 1 and "num_tokens" in batch else length
    shard = {key: value for key, value in batch.items() if key not in _UNSHARDED_KEYS}
    shard.update(
        input_ids=local(input_ids),
        position_ids=layout.position_ids,
        shift_labels=local(targets),
        num_tokens=rows * sum(max(0, min(stop, real_length) - start) for start, stop in layout.chunks),
    )
    return SequenceShard(batch=shard, layout=layout)


def check_same_rows(batch: dict[str, Any], group: dist.ProcessGroup, device: torch.device | str = "cpu") -> None:
    """Raise ``ValueError`` on every rank unless every rank of ``group`` holds the same ``batch`` (before sharding).

    Why: each rank keeps its own part of the row it was given, so ranks given different rows (a dataset split by
    global rank instead of by data-parallel rank, an unseeded shuffle) would train on a row stitched from
    several, silently when their lengths agree. One all-reduce of a few integers (shape and a checksum of the
    input ids and labels) over the group; a strategy calls it on the first batches, not on every one.
    """
    ids, labels = batch["input_ids"], batch["labels"]
    weights = torch.arange(1, ids.shape[-1] + 1, device=ids.device)
    found = torch.tensor(
        [*ids.shape, int((ids.long() * weights).sum()), int((labels.long() * weights).sum())], dtype=torch.int64
    ).to(device)
    extremes = torch.cat([found, -found])
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(extremes[: found.numel()], -extremes[found.numel() :]):
        raise ValueError(
            f"The ranks of a context-parallel group got different batches (rank {dist.get_rank(group)} of the group has "
            f"{list(ids.shape)} input_ids): every rank of a group must load the same rows, which it then splits. Split "
            "data over the data-parallel ranks only (Lightning's sampler does, with the strategy's "
            "distributed_sampler_kwargs), never over the global rank, and shuffle with the same seed on every rank."
        )
