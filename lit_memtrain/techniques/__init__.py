"""Memory techniques in plain torch, usable without Lightning: the chunked loss and log-probabilities, attention
that keeps packed documents apart, checkpointing, activation offloading, tiled MLPs, chunked RMSNorms, the
allocator setting and the memory timeline. The callbacks in :mod:`lit_memtrain.callbacks` apply them in a fit."""
