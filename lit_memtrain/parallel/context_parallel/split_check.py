"""Install context-parallel attention only in a model that computes on a split row what it computes on the whole row.

Why: context parallelism exchanges tokens inside the attention function it installs (:func:`install_attention`)
and nowhere else; every other layer runs on the rank's shard alone. That is exact for a transformer, whose other
layers act on each token by itself, and wrong, silently, for a model with any other layer that mixes tokens along
the sequence: a Mamba or linear-attention layer (Bamba, Granite 4 hybrid, Nemotron-H, Zamba2, Falcon-H1, Jamba,
Qwen3-Next) starts each shard's state from zero, a short convolution (LFM2) forgets the previous shard's last
tokens, and an attention that adds ALiBi or another bias outside the attention function, or never calls it
(BLOOM, MPT), attends within its shard alone.

Why a probe of the split itself, not a list of model types or module classes: a list misses the next hybrid and
every ``trust_remote_code`` model; looking for ``Conv1d`` or ``*Mamba*`` modules misses a mixing layer built from
other modules (a linear-attention layer is linears and a cumulative sum), a bias added in an attention module's own
code, or an attention class the interface is never called from, and would refuse a model whose convolution acts
on each token alone. The probe runs the model as training does, once on a whole row with its own attention and
once split over the group with the installed one, and compares what every token gets: whatever mixes the tokens,
and however, a difference shows it, and nothing else does (the rest of the setup is the one training uses).

Tolerance: the first chunk of the row is the row's beginning on either side, so nothing a split loses reaches it;
its change is the rounding of two attention kernels (the model's own against Ulysses' or ring's), on this model,
dtype and device. Later tokens may move 16 times that, and at least 16 times the output dtype's epsilon (the two
kernels reduce in other orders: ring merges blocks, so the first chunk can be exact while later ones are not).
A split Mamba state moved the tokens after the boundary by 0.3 (relative, per token) in a tiny random Bamba.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_memtrain.parallel.context_parallel.install import ContextParallelAttention, install_attention
from lit_memtrain.parallel.context_parallel.sharding import ShardLayout, shard_batch

__all__ = ["install_checked_attention"]

_TOKENS_PER_CHUNK = 8
_NOISE_FACTOR = 16.0


def _outputs(model: nn.Module, input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """The last hidden states of every token ``[tokens, hidden]`` (a causal LM's and a classifier's alike; the logits
    of a model that returns none), called as training calls the model on a shard: global positions, no mask, no
    cache."""
    output = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, output_hidden_states=True)
    states = getattr(output, "hidden_states", None)
    return (states[-1] if states else output.logits)[0]


def _token_errors(got: Tensor, expected: Tensor) -> Tensor:
    got, expected = got.double(), expected.double()
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp(min=torch.finfo(torch.float64).tiny)


def install_checked_attention(
    model: nn.Module,
    group: dist.ProcessGroup,
    method: str,
    inner: str,
    ring_backend: str,
    pad_token_id: int = 0,
    split_context: Callable[[ShardLayout], contextlib.AbstractContextManager[Any]] | None = None,
) -> ContextParallelAttention:
    """:func:`install_attention`, after checking that ``model`` computes on a row split over ``group`` what it computes
    on the whole row (see the module docstring). Every rank of the group calls it, with the same model.

    Args:
        model: the model (sharded or not), with its own attention implementation set.
        group, method, inner, ring_backend: as :func:`install_attention` takes them.
        pad_token_id: what the probe row's padding would hold (its length needs none).
        split_context: entered around the split forward with the probe row's layout (torch's ring kernels need
            theirs open: :func:`~lit_memtrain.parallel.context_parallel.torch_ring_attention`).

    Raises:
        ValueError: on every rank of the group, naming the model, the token where the split outputs first move and
            by how much, when it does not.
    """
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = size * (2 if method == "ring" else 1)
    length = _TOKENS_PER_CHUNK * chunks
    embeddings = model.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, embeddings.num_embeddings, (1, length), generator=generator).to(embeddings.weight.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = _outputs(model, ids, torch.arange(length, device=ids.device)[None])
        attention = install_attention(model, group, method, inner, ring_backend)
        try:
            shard = shard_batch({"input_ids": ids, "labels": ids}, rank, size, method, pad_token_id)
            attention.set_layout(shard.layout)
            with torch.no_grad(), split_context(shard.layout) if split_context else contextlib.nullcontext():
                local = _outputs(model, shard.batch["input_ids"], shard.batch["position_ids"])
            errors = torch.zeros(length, dtype=torch.float64, device=ids.device)
            offset = 0
            for start, stop in shard.layout.chunks:  # each token is held by one rank: the sum is every token's error
                errors[start:stop] = _token_errors(local[offset : offset + stop - start], reference[start:stop])
                offset += stop - start
            dist.all_reduce(errors, group=group)
        except BaseException:
            attention.uninstall()
            raise
    finally:
        model.train(training)
    first = length // chunks
    noise, moved = float(errors[:first].max()), errors[first:]
    tolerance = _NOISE_FACTOR * max(noise, torch.finfo(reference.dtype).eps)
    if float(moved.max()) > tolerance:
        attention.uninstall()
        token = first + int((moved > tolerance).nonzero()[0])
        name = type(model).__name__.removeprefix("FSDP")
        raise ValueError(
            f"{name} computes something else on a row split over {size} context-parallel ranks than on the whole "
            f"row: from token {token} (the first after a shard boundary is {first}) its last hidden states moved by up "
            f"to {float(moved.max()):.2e} (relative, per token), where the first shard moved by {noise:.2e} (allowed: "
            f"{tolerance:.1e}). ContextParallelStrategy exchanges tokens only inside the attention it installs; this "
            "model also mixes tokens along the sequence elsewhere (Mamba, linear-attention or convolution layers, "
            "ALiBi or another bias outside the attention function), and each rank would run those on its shard "
            "alone. Train it without context parallelism (FSDP2Strategy, with GradientCheckpointing, "
            "ActivationOffloading and the chunked loss for long rows)."
        )
    return attention
