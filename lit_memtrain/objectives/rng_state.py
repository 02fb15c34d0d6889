"""The random number generators' states of every rank, kept in a fit checkpoint and put back when it resumes.

Why: Lightning saves no RNG state, and ``seed_everything`` at the start of a resumed fit seeds the generators as at
the first step. Whatever draws from them after the resume (a GRPO / online-DPO completion sampled by ``generate``, the
order GRPO shuffles a rollout in, dropout) then replays the random numbers of the run's first steps instead of going
on with those of the uninterrupted run, silently: a resumed sampled run diverged from the uninterrupted one at its
first resumed step.

What is kept: torch's CPU generator, the current CUDA device's (when CUDA is initialised), Python's ``random`` and
NumPy's global generator, each rank's own (ranks draw different numbers: each generates for its own prompts). The
values are tensors, ints and tuples only, so a checkpoint loaded with ``weights_only=True`` reads them.

When they are put back: at the start of training (``on_train_start``), after the sanity check's validation and before
the first batch; the training loader must then draw nothing from them (``ResumableDataLoader`` has a generator of its
own), so that the first resumed batch starts from the state the checkpoint was saved in.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["every_ranks_rng_states", "rank_rng_states", "set_rng_states"]


def rank_rng_states() -> dict[str, Any]:
    """This process's generator states, in types ``torch.load(weights_only=True)`` reads."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(position), int(has_gauss),
                  float(cached)),
    }  # fmt: skip
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def every_ranks_rng_states() -> list[dict[str, Any]]:
    """Every rank's :func:`rank_rng_states`, by global rank (one entry without ``torch.distributed``). A collective:
    call it on every rank (a checkpoint is saved on every rank)."""
    states = rank_rng_states()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [states]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, states)
    return gathered


def set_rng_states(states: dict[str, Any]) -> None:
    """Put back the generator states :func:`rank_rng_states` returned."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
