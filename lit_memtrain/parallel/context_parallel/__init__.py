"""Context parallelism in plain torch: one sequence split across the ranks of a group.

Past a few hundred thousand tokens one device cannot hold a layer's working set; splitting the sequence itself
over ``cp`` ranks divides every activation by ``cp``. Only attention needs tokens from other ranks, so only
attention exchanges anything:

- ``method="ulysses"``: all-to-all from sequence shards to head shards and back around any single-device
  kernel (``sdpa_by_document``, flash-attn varlen, ``sdpa``), with the row's document bounds.
- ``method="ring"``: each rank's queries against the keys and values of the whole row, document by document
  (all-gathered, any device), or torch's ring kernels on CUDA for single-document rows.

A step on each rank of a group, without Lightning::

    check_context_parallel(model.config, cp_size, "ulysses", world_size)  # before any work
    attention = install_attention(model, cp_group, "ulysses")  # or install_checked_attention: refuses a Mamba hybrid
    shard = shard_batch(batch, cp_rank, cp_size, "ulysses")  # every rank of the group has the same batch
    attention.set_layout(shard.layout)
    hidden = model.model(input_ids=shard.batch["input_ids"], position_ids=shard.batch["position_ids"],
                         use_cache=False).last_hidden_state
    targets = shard.batch["shift_labels"].flatten()  # shifted on the whole row: not shifted again
    count = (targets != IGNORE_INDEX).sum()
    dist.all_reduce(count, group=cp_group)  # the row's trainable targets, each counted once
    loss = chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets, count)
    loss.backward()  # then sum gradients over the group (FSDP2 / DDP average: scale by the group size)

Each rank's loss is its own targets' sum divided by the whole row's count, so the group's losses and gradients
add up to one process's on the whole row. ``CausalLMModule`` does the same under
:class:`~lit_memtrain.strategies.ContextParallelStrategy`.
"""

from lit_memtrain.parallel.context_parallel.install import (
    ATTENTION_NAMES,
    RING_BACKENDS,
    ContextParallelAttention,
    install_attention,
)
from lit_memtrain.parallel.context_parallel.sharding import (
    SequenceShard,
    ShardLayout,
    check_same_rows,
    padded_length,
    shard_batch,
)
from lit_memtrain.parallel.context_parallel.split_check import install_checked_attention
from lit_memtrain.parallel.context_parallel.torch_ring import torch_ring_attention
from lit_memtrain.parallel.context_parallel.ulysses import INNER_ATTENTIONS
from lit_memtrain.parallel.context_parallel.validation import METHODS, check_context_parallel, ulysses_sizes

__all__ = [
    "ATTENTION_NAMES",
    "INNER_ATTENTIONS",
    "METHODS",
    "RING_BACKENDS",
    "ContextParallelAttention",
    "SequenceShard",
    "ShardLayout",
    "check_context_parallel",
    "check_same_rows",
    "install_attention",
    "install_checked_attention",
    "padded_length",
    "shard_batch",
    "torch_ring_attention",
    "ulysses_sizes",
]
