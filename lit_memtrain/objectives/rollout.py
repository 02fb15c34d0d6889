"""A rank's generation batch (its completions and what the loss needs of each), and the model batch that scores it.

Why apart from the module: the step trains the same completions several times (``num_iterations``, in
``steps_per_generation`` shuffled slices), and the policy, the sampling policy and the reference each score
them; a :class:`Rollout` keeps one value per completion (advantage) or per completion token (log-probabilities,
``[N, width]``, TRL's right-padded layout, which :mod:`~lit_memtrain.objectives.policy_loss` reads), and
:func:`scoring_batch` lays a slice of it out for the model: one padding-free row of prompt + completion documents
(position ids restarting per document, so completions never attend to one another), or right-padded rows.
``positions`` then says where in that batch's flattened targets each completion token's log-probability is, so
the token log-probabilities of the row go back to ``[N, width]`` without a ``[tokens, vocab]`` tensor anywhere.

Tokens after a completion's first end of sequence are not in it (the generation backend cut them); a truncated
completion under ``mask_truncated_completions`` keeps its tokens in the row (so the layout is the same) but none is
trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lit_memtrain.datamodules.batch import IGNORE_INDEX
from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator

__all__ = ["Rollout", "scoring_batch"]


@dataclass(frozen=True)
class Rollout:
    """``N`` completions (``num_generations`` per prompt, adjacent) and what a step computes of each.

    Attributes:
        prompt_ids: the prompt of each completion (repeated per generation), as generated from.
        completion_ids: each completion's tokens, through its first end of sequence.
        trained: ``[N]`` bool, False for a completion none of whose tokens is trained (a truncated one under
            ``mask_truncated_completions``).
        width: the longest completion of the generation batch: the ``T`` of every ``[N, T]`` tensor, slices too.
        advantages: ``[N]``.
        old_logps: ``[N, width]`` log-probabilities under the policy that sampled the completions, when the step
            trains off-policy (else None: the current ones, detached).
        ref_logps: ``[N, width]`` the reference's, when ``beta != 0``.
        sampling_logps: ``[N, width]`` the log-probabilities the generation engine sampled with, when it reports
            them (vLLM); NaN where it gave none.
        sampling_ratio: the vLLM importance-sampling weights of the tokens' losses (``[N, width]``, or ``[N, 1]``
            per sequence; :class:`~lit_memtrain.objectives.sampling_correction.SamplingCorrection`).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    trained: Tensor
    width: int
    advantages: Tensor | None = None
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    sampling_logps: Tensor | None = None
    sampling_ratio: Tensor | None = None

    @classmethod
    def of(
        cls, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]], trained: Tensor
    ) -> Rollout:
        """A rollout of these completions, ``width`` their longest (at least 1)."""
        if not len(prompt_ids) == len(completion_ids) == trained.numel():
            raise ValueError(
                f"A rollout needs one prompt and one trained flag per completion; got {len(prompt_ids)} prompts, "
                f"{len(completion_ids)} completions and {trained.numel()} flags."
            )
        width = max([len(c) for c in completion_ids] + [1])
        return cls([list(p) for p in prompt_ids], [list(c) for c in completion_ids], trained.bool(), width)

    def __len__(self) -> int:
        return len(self.completion_ids)

    def completion_mask(self) -> Tensor:
        """``[N, width]`` float: 1 on each trained completion token, 0 past a completion's end and on untrained ones."""
        lengths = torch.tensor([len(c) for c in self.completion_ids], dtype=torch.long)
        mask = torch.arange(self.width).unsqueeze(0) < lengths.unsqueeze(1)
        return (mask & self.trained.cpu().unsqueeze(1)).float()

    def select(self, indices: Sequence[int] | Tensor) -> Rollout:
        """The completions at ``indices``, in that order (``width`` unchanged)."""
        index = torch.as_tensor(indices, dtype=torch.long)
        rows = index.tolist()

        def take(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor[index.to(tensor.device)]

        return replace(
            self,
            prompt_ids=[self.prompt_ids[i] for i in rows],
            completion_ids=[self.completion_ids[i] for i in rows],
            trained=take(self.trained),
            advantages=take(self.advantages),
            old_logps=take(self.old_logps),
            ref_logps=take(self.ref_logps),
            sampling_logps=take(self.sampling_logps),
            sampling_ratio=take(self.sampling_ratio),
        )

    def with_sampling_logps(self, logprobs: Sequence[Sequence[float]]) -> Rollout:
        """This rollout with the engine's per-token log-probabilities of its completions (one list per completion,
        as long as it), laid out ``[N, width]`` (0 past a completion's end)."""
        lengths = [len(values) for values in logprobs]
        if lengths != [len(c) for c in self.completion_ids]:
            raise ValueError(
                f"The generation engine gave log-probabilities for {lengths} tokens where the completions have "
                f"{[len(c) for c in self.completion_ids]}."
            )
        padded = torch.zeros(len(self), self.width)
        for row, values in enumerate(logprobs):
            padded[row, : len(values)] = torch.tensor(values, dtype=torch.float32)
        return replace(self, sampling_logps=padded)

    def split(self, parts: int, order: Tensor | None = None) -> list[Rollout]:
        """``parts`` slices of equal size, of the completions in ``order`` (a permutation; None: as they are)."""
        if parts < 1 or len(self) % parts:
            raise ValueError(f"{len(self)} completions cannot be split into {parts} equal slices.")
        order = torch.arange(len(self)) if order is None else order
        size = len(self) // parts
        return [self.select(order[k * size : (k + 1) * size]) for k in range(parts)]


def scoring_batch(
    rollout: Rollout, pad_token_id: int, padding_free: bool = True, pad_to_multiple_of: int | None = None
) -> tuple[dict[str, object], Tensor]:
    """The model batch that scores ``rollout``'s completions, and where each completion token's target is in it.

    Each sequence is prompt + completion, labelled on the completion tokens it trains (-100 elsewhere), so the
    batch's targets (labels shifted left by one) put completion token ``t`` of sequence ``i`` at position
    ``start_i + len(prompt_i) - 1 + t``.

    Returns:
        The batch (:class:`~lit_memtrain.datamodules.padding_free.PaddingFreeCollator`'s one row, or
        :class:`~lit_memtrain.datamodules.collate.PaddedCollator`'s rows), on the host, and ``positions``:
        ``[N, width]`` long indices into its flattened targets (0 past a completion's end, where the mask is 0).
    """
    sequences = []
    for prompt, completion, trained in zip(rollout.prompt_ids, rollout.completion_ids, rollout.trained.tolist()):
        labels = completion if trained else [IGNORE_INDEX] * len(completion)
        sequences.append({"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + labels})
    if padding_free:
        batch = PaddingFreeCollator(pad_token_id, pad_to_multiple_of)(sequences)
        starts = [0]
        for sequence in sequences[:-1]:
            starts.append(starts[-1] + len(sequence["input_ids"]))
    else:
        batch = PaddedCollator(pad_token_id, pad_to_multiple_of)(sequences)
        starts = [row * batch["input_ids"].shape[1] for row in range(len(sequences))]
    positions = torch.zeros(len(rollout), rollout.width, dtype=torch.long)
    for row, (start, prompt, completion) in enumerate(zip(starts, rollout.prompt_ids, rollout.completion_ids)):
        first = start + len(prompt) - 1
        positions[row, : len(completion)] = torch.arange(first, first + len(completion))
    return batch, positions
