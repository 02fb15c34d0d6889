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
    attention = install_attention(model, cp_group, "ulysses")
    shard = shard_batch(batch, cp_rank, cp_size, "ulysses")  # every rank of the group has the same batch
    attention.set_layout(shard.layout)
    hidden = model.model(input_ids=shard.batch["input_ids"], position_ids=shard.batch["position_ids"],
                         use_cache=False).last_hidden_state
    loss = shard_loss(hidden, model.lm_head.weight, shard.batch["shift_labels"],
                      global_target_count(shard.batch["shift_labels"], cp_group))
    loss.backward()  # then sum gradients over the group (FSDP2 / DDP average: scale by the group size)
"""

from lit_memtrain.parallel.context_parallel.install import (
    ATTENTION_NAMES,
    RING_BACKENDS,
    ContextParallelAttention,
    install_attention,
)
from lit_memtrain.parallel.context_parallel.loss import global_target_count, shard_loss
from lit_memtrain.parallel.context_parallel.sharding import (
    SequenceShard,
    ShardLayout,
    check_same_rows,
    padded_length,
    shard_batch,
)
from lit_memtrain.parallel.context_parallel.torch_ring import torch_ring_attention
from lit_memtrain.parallel.context_parallel.ulysses import INNER_ATTENTIONS
from lit_memtrain.parallel.context_parallel.validation import METHODS, check_context_parallel, check_group_size, ulysses_sizes

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
    "check_group_size",
    "global_target_count",
    "install_attention",
    "padded_length",
    "shard_batch",
    "shard_loss",
    "torch_ring_attention",
    "ulysses_sizes",
]
