"""CompiledLayers: a fit with every decoder layer compiled equals the eager fit (losses, weights), compiles once
for every layer, restores the layers after the fit, keeps this package's attention out of the graphs, and refuses
what it is not shown to compose with. Captured with the ``aot_eager`` backend here (the graphs and their
autograd, without inductor's code generation, minutes on 2 cores); inductor runs in benchmarks/compiled_layers.py."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lit_memtrain import CausalLMModule
from lit_memtrain.callbacks import CompiledLayers, GradientCheckpointing
from lit_memtrain.datamodules.padding_free import PaddingFreeCollator
from lit_memtrain.models.layers import find_decoder_layers
from lit_memtrain.techniques.compiled_layers import compile_layers
from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp


def _packed_rows(steps: int = 4) -> list[dict]:
    """Padding-free rows of 128 tokens with a different packing at each step (the attention reads the bounds)."""
    packings = [(30, 50, 48), (128,), (20, 70, 38), (64, 64), (1, 2, 3, 4, 118)]
    generator = torch.Generator().manual_seed(1)
    rows = []
    for lengths in packings[:steps]:
        documents = [{"input_ids": ids, "labels": ids} for ids in (torch.randint(0, 512, (n,), generator=generator)
                                                                      for n in lengths)]  # fmt: skip
        rows.append(PaddingFreeCollator()(documents))
    return rows


def _fit(callbacks: list, layers: int = 3) -> tuple[list[float], dict[str, torch.Tensor], CausalLMModule]:
    """Four steps; the losses, the first step's gradients (before AdamW, which would magnify rounding in the
    smallest ones) and the module."""
    torch.manual_seed(0)
    module = CausalLMModule(preset="tiny-qwen3", config_overrides={"num_hidden_layers": layers}, learning_rate=1e-3,
                            warmup=0.0, min_lr_ratio=1.0)  # fmt: skip
    losses, gradients = [], {}

    class Record(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if not gradients:
                gradients.update({name: param.grad.clone() for name, param in pl_module.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, callbacks=[*callbacks, Record()])  # fmt: skip
    trainer.fit(module, DataLoader(_packed_rows(), batch_size=None))
    return losses, gradients, module


def test_a_fit_with_compiled_layers_equals_the_eager_fit_and_restores_the_layers():
    eager_losses, eager_gradients, _ = _fit([])
    losses, gradients, module = _fit([CompiledLayers(backend="aot_eager")])
    assert module.model.config._attn_implementation == "sdpa_by_document"  # packed rows: documents kept apart
    assert_each_equal_up_to_rounding(gradients, eager_gradients, terms=TINY_MODEL_TERMS)
    assert_each_equal_up_to_rounding(dict(enumerate(losses)), dict(enumerate(eager_losses)), terms=TINY_MODEL_TERMS)
    assert len(losses) == 4 and losses[0] != losses[-1]  # it trained
    assert not any("forward" in vars(layer) for layer in find_decoder_layers(module))  # eager again after the fit


def test_one_compilation_serves_every_layer_and_attention_stays_out_of_the_graphs():
    """The graphs a backend receives do not grow with the depth, and none holds an attention kernel: the
    document-aware attention runs eagerly between each layer's two graphs."""
    counts = {}
    for layers in (2, 6):
        graphs = []

        def counting(graph_module, example_inputs, graphs=graphs):
            graphs.append([str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"])
            return graph_module.forward

        torch.compiler.reset()  # graphs cached by an earlier test's compilation of the same code
        torch.manual_seed(0)
        module = CausalLMModule(preset="tiny-qwen3", config_overrides={"num_hidden_layers": layers})
        model = module.configure_model() or module.model
        model.set_attn_implementation("sdpa_by_document")
        restore = compile_layers(find_decoder_layers(model), backend=counting)
        for row in _packed_rows(2):
            kwargs = {key: row[key] for key in ("input_ids", "position_ids", "cu_seq_lens_q")}
            model(**kwargs, use_cache=False).logits.square().mean().backward()
        restore()
        counts[layers] = len(graphs)
        assert not any("scaled_dot_product" in target for graph in graphs for target in graph), graphs
    assert counts[2] == counts[6] > 0, counts


def test_what_it_does_not_compose_with_is_refused():
    with pytest.raises(ValueError, match="mode must be one of .* CUDA-graph modes"):
        CompiledLayers(mode="reduce-overhead")
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        callbacks=[GradientCheckpointing(), CompiledLayers(backend="aot_eager")])  # fmt: skip
    module = CausalLMModule(preset="tiny-qwen3")
    with pytest.raises(ValueError, match="CompiledLayers does not run with GradientCheckpointing: compiling through"):
        trainer.fit(module, DataLoader(_packed_rows(1), batch_size=None))
    several_processes = SimpleNamespace(callbacks=[], strategy=DDPStrategy())  # what on_fit_start reads of a trainer
    with pytest.raises(ValueError, match="CompiledLayers runs on one device, not under DDPStrategy"):
        CompiledLayers().on_fit_start(several_processes, module)
    layers = find_decoder_layers(module)
    restore = apply_tiled_mlp(layers)  # a technique applied without its callback
    with pytest.raises(ValueError, match=r"another technique already wrapped layers\.0\.mlp, layers\.1\.mlp"):
        compile_layers(layers, backend="aot_eager")
    restore()
