"""Cheap checks, run once at setup, that the model computes what the training step assumes.

Why probes rather than lists of names: the chunked loss takes the decoder's hidden states and the LM head's
weight and computes the logits itself, and padding-free batches rely on the attention implementation to
split a row into documents. A model that scales or caps its logits after the head (under any config name,
or in ``trust_remote_code`` code), or an attention implementation that ignores document boundaries, would
otherwise train on a different loss, silently. Each probe runs the real model on a few tokens, without
gradients, and either returns what it found or raises an error that says what to do.

- :func:`probe_logit_transform`: one forward in which the LM head's output is replaced by known values; the
  model's logits then show what it does after the head (``scale``, then ``softcap``), and the head's own
  input and output show that the chunked path's hidden states and weight are the ones the model uses.
- :func:`probe_document_isolation`: a document packed after another in one padding-free row must give the logits
  it gives alone, whatever document precedes it, within the rounding packing shows on the first document (a model
  without an LM head, such as a reward model, its decoder's last hidden states). Run for every
  attention implementation but context parallelism's (:data:`UNPROBED_DOCUMENT_ATTENTION`): an attention that
  keeps documents apart proves nothing of a model's other layers, and hybrid models (Mamba or linear-attention
  layers: Falcon-H1, Bamba, Granite 4, Jamba, Nemotron-H, Qwen3-Next...), ALiBi models (BLOOM, MPT) and recurrent
  ones carry one document's state into the next along a packed row under ``sdpa`` and ``eager`` too.
- :func:`probe_masked_packing`: a batch that carries an ``attention_mask`` must not hold packed documents
  (``position_ids`` restarting inside its attended tokens): transformers then takes the rows as plain padded ones
  and lets the documents attend to each other, as it tells no one.
- :func:`check_no_extra_loss_terms`: no term the model's own loss adds to the cross-entropy (Bamba's z-loss) that
  the causal-LM step would leave out (a config check; the causal-LM module runs it).

:class:`SetupProbes` runs each once for a module and keeps the verdicts its loss reads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lit_memtrain.datamodules.batch import is_padding_free
from lit_memtrain.models.lora import head_weight
from lit_memtrain.parallel.context_parallel import ATTENTION_NAMES as CONTEXT_PARALLEL_ATTENTION
from lit_memtrain.techniques.lm_head import transform_logits

__all__ = [
    "UNPROBED_DOCUMENT_ATTENTION",
    "LogitTransform",
    "SetupProbes",
    "check_no_extra_loss_terms",
    "probe_document_isolation",
    "probe_logit_transform",
    "probe_masked_packing",
]

# Context-parallel attention: each rank holds a shard of every row, so a whole row cannot run on one rank as the probe
# needs; it keeps documents apart by the row's bounds (tests/parallel/context_parallel), and the strategy refuses a
# model whose other layers mix tokens along the row when it installs it (install_checked_attention). Every other
# implementation is probed once, with the model: "sdpa" and "eager" keep the attention of documents apart (this
# project's tests), not the state a Mamba, linear-attention or convolution layer carries along the row.
UNPROBED_DOCUMENT_ATTENTION = frozenset(CONTEXT_PARALLEL_ATTENTION.values())

_PROBE_TOKENS = 8
_DESIGNED_RANGE = 64.0  # head outputs from -64 to 64: large enough to show any cap, small ones show a scale
_SCALE_NAMES = ("logit_scale", "lm_head_multiplier")  # multipliers applied after the head
_DIVISOR_NAMES = ("logits_scaling",)  # divisors applied after the head
_DOCUMENT_LENGTHS = (7, 5)


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its LM head's output: ``softcap * tanh(scale * logits / softcap)``."""

    scale: float = 1.0
    softcap: float | None = None


def _relative_error(got: Tensor, expected: Tensor) -> float:
    got, expected = got.double(), expected.double()
    return float((got - expected).norm() / expected.norm().clamp(min=torch.finfo(torch.float64).tiny))


def _tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between two ways of computing the same thing in ``dtype``."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _unsupported(model: nn.Module, reason: str) -> ValueError:
    return ValueError(
        f"The chunked loss cannot reproduce the logits of {type(model).__name__}: {reason}. Training on it would "
        "use a loss different from the model's own. Use loss_type='nll' (the model's logits and plain "
        "cross-entropy) for this model."
    )


def _probe_ids(model: nn.Module, lengths: tuple[int, ...], device: torch.device) -> list[Tensor]:
    vocab = model.get_input_embeddings().num_embeddings
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (1, n), generator=generator).to(device) for n in lengths]


def _device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


class _EvalMode:
    """``model.eval()`` and no gradients for the probe's forward, the previous mode restored after."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.training = self.model.training
        self.no_grad = torch.no_grad()
        self.no_grad.__enter__()
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.training)
        self.no_grad.__exit__(*exc)


def probe_logit_transform(model: nn.Module) -> LogitTransform:
    """Find what ``model`` does between its LM head and its logits, so the chunked loss can do the same.

    One forward over a few tokens, in eval mode and without gradients, with hooks on the decoder
    (``get_decoder()``) and the LM head (``get_output_embeddings()``); the head's output is replaced by
    designed values ``R`` from -64 to 64. Checked: the head's input is the decoder's last hidden state, the
    head's output is ``hidden @ W.T + b`` with the weight the chunked loss reads
    (:func:`lit_memtrain.models.lora.head_weight`, LoRA folded in), and the model's logits are
    ``softcap * tanh(scale * R / softcap)`` for one ``scale`` (measured on the small values of ``R``; a value
    the config names, such as ``logit_scale``, ``1 / logits_scaling`` or ``lm_head_multiplier``, when they
    agree) and the config's ``final_logit_softcapping`` (or no cap).

    Raises:
        ValueError: naming ``loss_type='nll'``, when any of this does not hold.
    """
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    if head is None:
        raise _unsupported(model, "it has no output embedding module (get_output_embeddings() is None)")
    seen: dict[str, Tensor] = {}

    def on_decoder(module: nn.Module, args: Any, output: Any) -> None:
        seen["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def on_head(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        weight, bias = head_weight(module)  # read inside forward, where sharded weights are whole
        seen["head_input"], seen["head_output"] = args[0], output
        seen["linear"] = F.linear(args[0], weight.to(args[0].dtype), None if bias is None else bias.to(args[0].dtype))
        designed = torch.linspace(-_DESIGNED_RANGE, _DESIGNED_RANGE, output.numel(), device=output.device)
        seen["designed"] = designed.view(output.shape)
        return seen["designed"]

    (ids,) = _probe_ids(model, (_PROBE_TOKENS,), _device(model))
    hooks = [decoder.register_forward_hook(on_decoder), head.register_forward_hook(on_head)]
    try:
        with _EvalMode(model):
            output = model(input_ids=ids, use_cache=False)
            logits = output.logits if hasattr(output, "logits") else output[0]
    finally:
        for hook in hooks:
            hook.remove()
    if "head_input" not in seen or "hidden" not in seen:
        raise _unsupported(model, "its forward does not call get_decoder() and get_output_embeddings() as modules")
    tolerance = _tolerance(seen["head_input"].dtype)
    head_input, hidden = seen["head_input"], seen["hidden"]
    if head_input.shape != hidden.shape or _relative_error(head_input, hidden) > tolerance:
        raise _unsupported(model, "its LM head does not take the decoder's last hidden state as it is")
    if _relative_error(seen["head_output"], seen["linear"]) > tolerance:
        raise _unsupported(model, "its LM head computes something other than hidden @ weight.T + bias")
    return _fit_transform(model, seen["designed"], logits.float())


def _fit_transform(model: nn.Module, designed: Tensor, logits: Tensor) -> LogitTransform:
    config = _text_config(model)
    softcap = getattr(config, "final_logit_softcapping", None) or None
    small = (designed.abs() <= 1) & (designed != 0)
    inner = logits[small]
    if softcap is not None:
        inner = softcap * torch.atanh((inner / softcap).clamp(-1 + 1e-7, 1 - 1e-7))
    measured = float((inner * designed[small]).sum() / designed[small].square().sum())
    if not measured > 0 or not math.isfinite(measured):
        raise _unsupported(model, f"its logits do not grow with its LM head's output (measured scale {measured})")
    named = [1.0]
    named += [float(getattr(config, name)) for name in _SCALE_NAMES if getattr(config, name, None)]
    named += [1.0 / float(getattr(config, name)) for name in _DIVISOR_NAMES if getattr(config, name, None)]
    closest = min(named, key=lambda value: abs(value - measured))
    scale = closest if abs(closest - measured) <= 1e-3 * measured else measured
    transform = LogitTransform(scale=scale, softcap=softcap)
    error = _relative_error(logits, transform_logits(designed, softcap, scale))
    if error > _tolerance(logits.dtype):
        cap = f", then capped at final_logit_softcapping={softcap}" if softcap else ""
        raise _unsupported(
            model, f"its logits are not its LM head's output times {scale:.6g}{cap} (relative error {error:.2e})"
        )
    return transform


def _per_token_outputs(model: nn.Module, inputs: dict[str, Any]) -> Tensor:
    """What ``model`` computes at every token: a causal LM's logits; for a model without an LM head (a
    sequence-classification model pools one position per row), its decoder's last hidden states."""
    if model.get_output_embeddings() is not None:
        return model(**inputs).logits.float()
    seen: dict[str, Tensor] = {}

    def on_decoder(module: nn.Module, args: Any, output: Any) -> None:
        seen["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    hook = model.get_decoder().register_forward_hook(on_decoder)
    try:
        model(**inputs)
    finally:
        hook.remove()
    return seen["hidden"].float()


def _token_error(got: Tensor, expected: Tensor) -> float:
    """The largest relative change of one token's outputs (``[tokens, features]``): a leak confined to a document's
    first tokens (a short convolution's) is not diluted over the rest."""
    got, expected = got.double(), expected.double()
    tiny = torch.finfo(torch.float64).tiny
    return float(((got - expected).norm(dim=-1) / expected.norm(dim=-1).clamp(min=tiny)).max())


# A fp32 output rounded twice differs by a few units in the last place (2**-23 relative); an isolating model's
# first document moved by 1e-7 to 3e-7 on the tiny test models (0 in bf16 on the CPU, 0 under sdpa_by_document).
_NOISE_FLOOR = 2.0**-20
_NOISE_FACTOR = 16.0


def probe_document_isolation(
    model: nn.Module, model_inputs: Callable[[dict[str, Any]], dict[str, Any]], attn_implementation: str
) -> None:
    """Check that a document packed after another in one padding-free row gets the outputs it gets alone, and the
    same outputs whatever document precedes it.

    Two rows are run, ``[A, D]`` and ``[B, D]`` (``A`` and ``B`` random documents of one length, ``D`` a shorter
    one), and each document alone. Compared per token (:func:`_token_error`): ``D`` in each row against ``D``
    alone (an attention that ignores the bounds, positions that do not restart), and ``D`` after ``B`` against
    ``D`` after ``A`` (any state carried along the row: Mamba, linear attention, a convolution, ALiBi).

    Why a measured tolerance rather than a fixed one: a fixed 1e-4 (fp32) let a tiny random LFM2 through, whose
    short convolutions moved ``D`` by 1.3e-4 per token (8.5e-5 over the whole document), and 5e-2 (half precision)
    let Falcon-H1 through at 3.9e-3. What packing may change in an isolating model is the rounding of the same
    computation in another shape (another number of rows per kernel call, the tokens an expert gets in a
    mixture-of-experts layer): the first documents show it, as nothing precedes them in a causal model, on this
    model, dtype, device and kernels (TF32, GPU reductions included). ``D`` may move 16 times that, and at least
    16 times 2**-20 relative (8 fp32 units in the last place): isolating models moved ``D`` by at most 2.6e-7 in
    fp32 (a mixture of experts' regrouping: 5e-8 between the two rows; others bit for bit) and not at all in bf16
    on the CPU, while the leaks measured were 1.3e-4 (LFM2) to 0.45 per token, and 3.8e-4 in bf16 (LFM2, between
    the two rows).

    Args:
        model: the causal LM, or a model with another head on its decoder (compared on its last hidden states).
        model_inputs: turns a padding-free batch (``input_ids``, ``position_ids`` restarting per document,
            ``cu_seq_lens_q/k``, ``max_length_q/k``) into the model's keyword arguments, as training does.
        attn_implementation: named in the error.

    Raises:
        ValueError: ``D`` moved more than the tolerance, so documents see each other (through the attention, or
            through layers that carry state along the row).
    """
    first_length, last_length = _DOCUMENT_LENGTHS
    *firsts, last = _probe_ids(model, (first_length, first_length, last_length), _device(model))
    bounds = torch.tensor([0, first_length, first_length + last_length], dtype=torch.int32)
    positions = torch.cat([torch.arange(first_length), torch.arange(last_length)])[None].to(last.device)

    def packed(first: Tensor) -> dict[str, Any]:
        row = torch.cat([first, last], dim=1)
        on_device = bounds.to(row.device)
        return {"input_ids": row, "labels": row, "position_ids": positions, "cu_seq_lens_q": on_device,
                "cu_seq_lens_k": on_device, "max_length_q": first_length, "max_length_k": first_length}  # fmt: skip

    with _EvalMode(model):
        rows = [_per_token_outputs(model, model_inputs(packed(first)))[0] for first in firsts]
        alone = [_per_token_outputs(model, {"input_ids": ids, "use_cache": False})[0] for ids in (*firsts, last)]
    noise = max(_token_error(row[:first_length], own) for row, own in zip(rows, alone))
    moved = max(
        *(_token_error(row[first_length:], alone[-1]) for row in rows),
        _token_error(rows[1][first_length:], rows[0][first_length:]),
    )
    tolerance = _NOISE_FACTOR * max(noise, _NOISE_FLOOR)
    if moved > tolerance:
        raise ValueError(
            f"attn_implementation={attn_implementation!r} lets packed documents attend to each other in "
            f"{type(model).__name__}: a document packed after another in one padding-free row got outputs {moved:.2e} "
            f"(relative, per token) away from its own outputs alone or after another document, where packing moved "
            f"the first document by {noise:.2e} (allowed: {tolerance:.1e}). Either the attention ignores the "
            "documents' bounds (use 'sdpa_by_document', 'sdpa', 'eager' or a flash-attention kernel), or the model's "
            "other layers carry one document's state into the next (Mamba, linear attention, convolutions, ALiBi), "
            "which no attention setting changes: turn off packing and padding_free for this model."
        )


_EXTRA_LOSS_COEFFICIENTS = ("z_loss_coefficient",)  # Bamba: + coefficient * mean(logsumexp(logits)^2), every position


def check_no_extra_loss_terms(model: nn.Module) -> None:
    """Refuse a model whose own loss adds a term to the cross-entropy (and the router load-balancing loss) that the
    causal-LM training step does not compute.

    Why: ``CausalLMModule`` computes the cross-entropy itself (chunked, or from the logits) rather than taking the
    model's ``loss``; a term the model's forward adds after it, such as Bamba's logit z-loss when its
    ``z_loss_coefficient`` is above 0, would be missing from the training loss, silently.

    Raises:
        ValueError: naming the setting and the override that turns it off.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = _text_config(model)
    for name in _EXTRA_LOSS_COEFFICIENTS:
        value = getattr(base, name, None) or getattr(config, name, None)
        if value:
            raise ValueError(
                f"{type(base).__name__}'s own loss adds a term weighted by {name}={value} to the cross-entropy, which "
                f"lit-memtrain's causal-LM loss does not compute: training would leave it out. Set "
                f"config_overrides={{{name!r}: 0}} (or model_init_kwargs) to train on the cross-entropy alone."
            )


def probe_masked_packing(batch: dict[str, Any]) -> None:
    """Refuse a batch whose rows carry an ``attention_mask`` and packed documents.

    Why: transformers keeps packed documents apart by the restarts of ``position_ids`` only when no
    ``attention_mask`` is passed (``find_packed_sequence_indices``); a collator that adds one (even all ones)
    to packed rows makes them plain padded rows, whose documents attend to each other, silently. Positions
    that restart between two attended tokens of a row are such documents. Reads the batch's values (once: a
    collator lays out every batch alike).

    Raises:
        ValueError: naming the row and the position where a document restarts under the mask.
    """
    mask, positions = batch.get("attention_mask"), batch.get("position_ids")
    if not isinstance(mask, Tensor) or not isinstance(positions, Tensor) or mask.dim() != 2 or mask.shape[1] < 2:
        return
    attended = mask.bool()
    positions = positions.expand(mask.shape)
    restarts = attended[:, 1:] & attended[:, :-1] & (positions[:, 1:] != positions[:, :-1] + 1)
    found = restarts.nonzero()
    if found.numel():
        row, column = found[0].tolist()
        raise ValueError(
            f"The batch carries an attention_mask and packed documents: in row {row} the position ids restart at "
            f"token {column + 1} (from {int(positions[row, column])} to {int(positions[row, column + 1])}) between "
            "two attended tokens. With an attention_mask transformers ignores the restarts and lets the documents "
            "attend to each other. Give packed rows without attention_mask (PaddingFreeCollator, or "
            "SFTDataModule(packing=True)), or one document per row with its mask."
        )


class SetupProbes:
    """The probes one module's training needs, each run once, and their verdicts.

    Attributes:
        logit_transform: what the chunked loss applies after the LM head; ``None`` until probed.
        isolating_attention: the attention implementation last found to keep packed documents apart.
    """

    def __init__(self) -> None:
        self.logit_transform: LogitTransform | None = None
        self.isolating_attention: str | None = None
        self.batch_layout_checked = False

    def run(
        self,
        model: nn.Module,
        chunked_loss: bool,
        batch: dict[str, Any] | None = None,
        model_inputs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        """Probe what has not been yet: the logit transform for a ``chunked_loss``, the first ``batch``'s layout
        (:func:`probe_masked_packing`), and, for a padding-free
        ``batch`` whose attention implementation is not in :data:`UNPROBED_DOCUMENT_ATTENTION`, that it keeps packed
        documents apart (with ``model_inputs``, the training step's own, see :func:`probe_document_isolation`).

        Raises:
            ValueError: a probe failed (see each probe).
        """
        if chunked_loss and self.logit_transform is None:
            self.logit_transform = probe_logit_transform(model)
            if self.logit_transform != LogitTransform():
                rank_zero_info(f"chunked loss: applying the model's logit transform {self.logit_transform}")
        if batch is not None and not self.batch_layout_checked:
            probe_masked_packing(batch)
            self.batch_layout_checked = True
        if batch is None or not is_padding_free(batch):
            return
        name = model.config._attn_implementation
        if name in UNPROBED_DOCUMENT_ATTENTION or name == self.isolating_attention:
            return
        probe_document_isolation(model, model_inputs, name)
        rank_zero_info(f"attn_implementation={name!r} keeps packed documents apart (probed at setup)")
        self.isolating_attention = name

    def assume_passed(
        self, logit_transform: LogitTransform | None = None, document_attention: str | None = None
    ) -> None:
        """Record verdicts without running the probes, for a caller that runs the step on tensors without values
        (the planner's fake tensors), where a probe cannot read what the model computes.

        Args:
            logit_transform: what the chunked loss is to apply after the LM head (``LogitTransform()``: nothing).
            document_attention: an attention implementation to take as keeping packed documents apart (and the
                batches' layout as checked: :func:`probe_masked_packing` reads values too).
        """
        if logit_transform is not None:
            self.logit_transform = logit_transform
        if document_attention is not None:
            self.isolating_attention = document_attention
            self.batch_layout_checked = True
