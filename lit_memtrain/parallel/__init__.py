"""Parallelism in plain torch: FSDP2 sharding of a causal LM (:mod:`~lit_memtrain.parallel.fsdp`) and context
parallelism (:mod:`~lit_memtrain.parallel.context_parallel`). The Lightning strategies in
:mod:`lit_memtrain.strategies` apply them in a fit."""
