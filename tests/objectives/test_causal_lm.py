import copy
import importlib.util
import math

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_each_equal_up_to_rounding, assert_equal_up_to_rounding
from memory_effects import TechniquesInEffect
from transformers import AutoModelForCausalLM

from lit_memtrain.datamodules.collate import PaddedCollator
from lit_memtrain.objectives.causal_lm import CausalLMModule
from lit_memtrain.datamodules.batch import shift_targets
from lit_memtrain.objectives.checkpoint_io import load_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 512}


def _batch(vocab: int, rows: int = 2, length: int = 12, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :4] = -100
    return {"input_ids": ids, "labels": labels}


def _module(preset: str = "tiny-qwen3", **kwargs) -> CausalLMModule:
    torch.manual_seed(0)
    module = CausalLMModule(preset=preset, **kwargs)
    module.configure_model()
    return module


def test_shift_targets():
    assert shift_targets(torch.tensor([[1, 2, 3]])).tolist() == [[2, 3, -100]]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-llama"])
def test_chunked_loss_matches_plain_loss_and_gradients(preset):
    chunked = _module(preset, loss_type="chunked", loss_chunk_size=5)
    plain = _module(preset, loss_type="nll")
    batch = _batch(chunked.model.config.vocab_size)
    loss_c, loss_p = chunked.compute_loss(batch), plain.compute_loss(batch)
    loss_c.backward()
    loss_p.backward()
    assert_equal_up_to_rounding(loss_c, loss_p, name="loss", terms=TINY_MODEL_TERMS)
    for (name, a), b in zip(chunked.model.named_parameters(), plain.model.parameters()):
        assert_equal_up_to_rounding(a.grad, b.grad, name=name, terms=TINY_MODEL_TERMS)


@pytest.mark.parametrize("loss_type", ["chunked", "nll"])
def test_all_ignored_labels_give_zero_loss_connected_to_graph(loss_type):
    module = _module(loss_type=loss_type)
    batch = _batch(module.model.config.vocab_size)
    batch["labels"].fill_(-100)
    loss = module.compute_loss(batch)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in module.model.parameters() if p.grad is not None]
    assert grads and all(torch.all(g == 0) for g in grads)


def test_padded_batch_loss_equals_token_weighted_loss_of_each_example():
    module = _module()
    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9]}, {"input_ids": [3, 4, 5], "labels": [3, 4, 5]}]
    batch = PaddedCollator(pad_token_id=0, pad_to_multiple_of=8)(examples)
    batched = module.compute_loss(batch)
    singles = [module.compute_loss(PaddedCollator(0)([e])) for e in examples]
    counts = [3, 2]  # trainable targets after the shift: 7, 8, 9 and 4, 5
    expected = sum(loss * n for loss, n in zip(singles, counts)) / sum(counts)
    assert_equal_up_to_rounding(batched, expected, name="loss", terms=TINY_MODEL_TERMS)


def test_export_reloads_with_identical_logits(tmp_path, tokenizer):
    module = _module(tokenizer="lit-memtrain/embedded", export_dir=str(tmp_path / "export"))
    path = module.export(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    ids = torch.randint(0, len(tokenizer), (2, 10))
    module.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(module.model(ids).logits, reloaded(ids).logits, rtol=0, atol=0)
    assert (path / "tokenizer.json").exists()
    assert module.model.config.vocab_size == 512  # the preset's vocabulary, larger than the tokenizer's 384


def test_loads_a_local_pretrained_model_with_yarn_rope(tmp_path):
    _module().model.save_pretrained(tmp_path / "base")
    plain = CausalLMModule(model=str(tmp_path / "base"))
    plain.configure_model()
    yarn = CausalLMModule(model=str(tmp_path / "base"), model_init_kwargs={"rope_parameters": YARN})
    yarn.configure_model()
    assert yarn.model.config.rope_parameters["rope_type"] == "yarn"
    assert plain.model.config.rope_parameters["rope_type"] == "default"
    rotary_plain, rotary_yarn = plain.model.model.rotary_emb, yarn.model.model.rotary_emb
    assert rotary_yarn.attention_scaling > 1.0 == rotary_plain.attention_scaling
    assert not torch.allclose(rotary_plain.inv_freq, rotary_yarn.inv_freq)


def test_a_yarn_override_that_drops_the_models_partial_rotary_factor_is_refused(tmp_path):
    """transformers replaces rope_parameters whole: GLM's partial_rotary_factor (0.5) left out of the YaRN dict made
    every head dimension rotate (GLM reads the key with a default of 1.0), another model, silently."""
    config = {"model_type": "glm", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    base = CausalLMModule(config=config)
    base.configure_model()
    base.model.save_pretrained(tmp_path / "glm")
    own = base.model.config.rope_parameters
    assert own["partial_rotary_factor"] == 0.5
    yarn = {"rope_type": "yarn", "rope_theta": own["rope_theta"], "factor": 4.0, "original_max_position_embeddings": 16}
    for source in ({"model": str(tmp_path / "glm")}, {"config": config}):
        with pytest.raises(ValueError, match=r"leaves out partial_rotary_factor=0\.5, which the model was trained"):
            CausalLMModule(**source, model_init_kwargs={"rope_parameters": yarn}).configure_model()
    kept = CausalLMModule(model=str(tmp_path / "glm"), model_init_kwargs={"rope_parameters": {**yarn, **own, **yarn}})
    kept.configure_model()
    assert kept.model.config.rope_parameters["rope_type"] == "yarn"
    rotary, own_rotary = kept.model.model.rotary_emb, base.model.model.rotary_emb
    assert rotary.inv_freq.shape == own_rotary.inv_freq.shape == (2,)  # half of head_dim 8 rotates: 2 frequencies
    with pytest.raises(ValueError, match=r"leaves out rope_theta=1000000\.0"):
        _module(config_overrides={"rope_parameters": {"rope_type": "linear", "factor": 2.0}})


def test_a_rope_override_may_leave_out_a_partial_rotary_factor_of_one():
    """Phi-3 keeps partial_rotary_factor 1.0 in its rope_parameters, the value transformers reads when the key is
    absent: a LongRoPE dict without it rotates every head dimension as the model does, and is not refused."""
    config = {"model_type": "phi3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "original_max_position_embeddings": 16,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    base = CausalLMModule(config=config)
    base.configure_model()
    assert base.model.config.rope_parameters["partial_rotary_factor"] == 1.0
    longrope = {"rope_type": "longrope", "rope_theta": base.model.config.rope_parameters["rope_theta"],
                "short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 16}
    module = CausalLMModule(config=config, model_init_kwargs={"rope_parameters": longrope})
    module.configure_model()
    rotary, own_rotary = module.model.model.rotary_emb, base.model.model.rotary_emb
    assert rotary.rope_type == "longrope"
    assert rotary.inv_freq.shape == own_rotary.inv_freq.shape == (4,)  # head_dim 8: every dimension rotates


def test_a_single_yarn_dict_for_a_model_with_rope_parameters_per_layer_type_is_refused():
    """Gemma 3 keeps rope_parameters per layer type: given one YaRN dict, transformers kept each type's own and no
    layer scaled its positions, silently."""
    config = {"model_type": "gemma3_text", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    with pytest.raises(ValueError, match="keeps its rope_parameters per layer type .'sliding_attention', 'full_attent"):
        CausalLMModule(config=config, model_init_kwargs={"rope_parameters": YARN}).configure_model()
    per_type = {"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    module = CausalLMModule(config=config, model_init_kwargs={"rope_parameters": per_type})
    module.configure_model()
    assert module.model.model.rotary_emb.rope_type == {"full_attention": "yarn", "sliding_attention": "default"}


def test_model_init_kwargs_reach_a_model_built_from_a_preset():
    module = _module(model_init_kwargs={"rope_parameters": YARN})
    assert module.model.config.rope_parameters == module.model.model.rotary_emb.config.rope_parameters
    assert module.model.config.rope_parameters["rope_type"] == "yarn"
    assert module.model.model.rotary_emb.rope_type == "yarn"


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_flash_attn_names_the_extra():
    with pytest.raises(ValueError, match=r"lit-memtrain\[flash\]"):
        CausalLMModule(preset="tiny-qwen3", attn_implementation="flash_attention_2")


def test_hub_kernel_attention_names_pass_through(monkeypatch):
    seen = {}

    def fake_from_config(config, **kwargs):
        seen.update(kwargs)
        return torch.nn.Linear(1, 1)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", fake_from_config)
    CausalLMModule(preset="tiny-qwen3", attn_implementation="kernels-community/flash-attn").configure_model()
    assert seen["attn_implementation"] == "kernels-community/flash-attn"


def test_needs_exactly_one_model_source():
    with pytest.raises(ValueError, match="exactly one of model"):
        CausalLMModule()
    with pytest.raises(ValueError, match=r"got \['model', 'preset'\]"):
        CausalLMModule(model="x", preset="tiny-qwen3")
    with pytest.raises(ValueError, match="Unknown model preset 'nope'"):
        CausalLMModule(preset="nope")


def test_validation_metrics_survive_inference_mode_then_no_grad(tmp_path):
    from lightning.pytorch import Trainer

    from lit_memtrain.datamodules.sft import SFTDataModule

    module = _module(tokenizer="lit-memtrain/embedded")
    data = SFTDataModule(max_length=48, batch_size=8, val_size=16)
    results = []
    for inference_mode in (True, False):
        trainer = Trainer(logger=False, enable_progress_bar=False, inference_mode=inference_mode, default_root_dir=tmp_path)
        results.append(trainer.validate(module, datamodule=data, verbose=False)[0])
    assert_equal_up_to_rounding(results[0]["val/loss"], results[1]["val/loss"], name="val/loss", terms=TINY_MODEL_TERMS)
    assert results[0]["val/ppl"] == pytest.approx(math.exp(results[0]["val/loss"]), rel=1e-5)
    assert 0.0 <= results[0]["val/token_accuracy"] <= 1.0


def test_progress_bar_shows_loss_tokens_per_second_and_peak_memory(tmp_path):
    from lightning.pytorch import Trainer

    from lit_memtrain.callbacks import MemoryMonitor
    from lit_memtrain.datamodules.sft import SFTDataModule

    module = _module(tokenizer="lit-memtrain/embedded")
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=True, callbacks=[MemoryMonitor()], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=SFTDataModule(max_length=48, batch_size=4))
    shown = trainer.progress_bar_metrics
    assert_equal_up_to_rounding(shown["train/loss"], module.last_train_loss, name="train/loss", terms=1)
    assert shown["train/tokens_per_sec"] > 0
    assert shown["memory/rss_gib"] > 0.1  # this process holds torch and a model


def test_learning_rate_warms_up_then_decays_on_a_cosine_to_the_floor(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import Callback

    from lit_memtrain.datamodules.sft import SFTDataModule

    class RecordLearningRate(Callback):
        def __init__(self):
            self.values = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.values.append(trainer.optimizers[0].param_groups[0]["lr"])

    record = RecordLearningRate()
    module = _module(tokenizer="lit-memtrain/embedded", learning_rate=1e-3, warmup=4, min_lr_ratio=0.1)
    trainer = Trainer(max_steps=20, logger=False, enable_progress_bar=False, callbacks=[record], default_root_dir=tmp_path)
    trainer.fit(module, datamodule=SFTDataModule(max_length=32, batch_size=2))
    lr = record.values
    assert lr[:5] == pytest.approx([1e-3 * (s + 1) / 5 for s in range(4)] + [1e-3])
    assert all(a >= b for a, b in zip(lr[4:], lr[5:]))
    expected_last = 1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 15 / 16))
    assert lr[-1] == pytest.approx(expected_last)


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused():
    with pytest.raises(ValueError, match="has 384 tokens but the model's embedding has only 64 rows"):
        _module(tokenizer="lit-memtrain/embedded", config_overrides={"vocab_size": 64})


def test_a_pretrained_model_with_the_demo_tokenizer_is_refused(tmp_path):
    _module().model.save_pretrained(tmp_path / "base")  # 512 rows, not the demo tokenizer's 384
    with pytest.raises(ValueError, match="paired with the embedded demo tokenizer"):
        CausalLMModule(model=str(tmp_path / "base"), tokenizer="lit-memtrain/embedded").configure_model()


def test_bf16_trainable_weights_warn_about_lost_updates():
    module = _module(dtype="bfloat16")
    from lightning.pytorch import Trainer

    module.trainer = Trainer(max_steps=10, logger=False)
    with pytest.warns(UserWarning, match="rounds away updates"):
        module.configure_optimizers()


def test_gradient_accumulation_weights_every_token_equally(tmp_path):
    """Two micro-batches with 4 and 1 trainable tokens give the gradient of the 5-token mean loss."""
    update, gradient, _ = _accumulation_run(tmp_path)
    # the update w - (w - g) rounds at the weights' magnitude: tiny-qwen3's are at most about 1 (its norms')
    assert_each_equal_up_to_rounding(update, gradient, terms=TINY_MODEL_TERMS, scale=1.0)


def test_memory_callbacks_take_effect_and_keep_the_step_mean_gradient(tmp_path):
    """Checkpointing, tiled MLPs and activation offloading act on every layer of an SFT fit, which updates the
    weights by the plain 5-token mean gradient all the same."""
    from lit_memtrain.callbacks import ActivationOffloading, GradientCheckpointing, TiledMLP

    offloading = ActivationOffloading(min_offload_bytes=0, offload_cpu_tensors_for_testing=True)
    in_effect = TechniquesInEffect()
    update, gradient, _ = _accumulation_run(
        tmp_path, callbacks=[GradientCheckpointing(), TiledMLP(num_tiles=2), offloading, in_effect]
    )
    in_effect.assert_in_effect(offloading=offloading)
    assert_each_equal_up_to_rounding(update, gradient, terms=TINY_MODEL_TERMS, scale=1.0)  # as above


def test_ddp_ranks_with_different_token_counts_train_on_the_global_mean(tmp_path):
    """Rank 0 sees 4 trainable tokens and rank 1 sees 1: the update is that of the 5-token mean loss."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9]}, {"input_ids": [3, 4, 5], "labels": [-100, -100, 5]}]

    class PerRankData(CausalLMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

        def train_dataloader(self):
            return DataLoader([examples[self.global_rank]], batch_size=1, collate_fn=PaddedCollator(pad_token_id=0))

    torch.manual_seed(0)
    module = PerRankData(preset="tiny-qwen3")
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = copy.deepcopy(module)
    reference.compute_loss(PaddedCollator(pad_token_id=0)(examples)).backward()
    trainer = Trainer(
        max_steps=1, accelerator="cpu", devices=2, strategy="ddp_fork", use_distributed_sampler=False,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, default_root_dir=tmp_path,
    )
    trainer.fit(module)
    for name, p in module.named_parameters():  # the update w - (w - g) rounds at the weights' magnitude
        expected, weights = dict(reference.named_parameters())[name].grad, float(before[name].abs().max())
        update = before[name] - p.detach()
        assert_equal_up_to_rounding(update, expected, name=name, terms=TINY_MODEL_TERMS, scale=weights)
    assert float(trainer.callback_metrics["train/tokens"]) == 5 + 3  # both ranks' tokens, not rank 0's 5


def test_resumed_runs_keep_their_token_count_and_losses(tmp_path):
    from lightning.pytorch import Trainer

    from lit_memtrain.datamodules.sft import SFTDataModule

    module = _module(tokenizer="lit-memtrain/embedded")
    trainer = Trainer(max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=SFTDataModule(max_length=32, batch_size=2))
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    restored = load_checkpoint(tmp_path / "run.ckpt")  # weights_only=True
    assert restored.train_tokens_seen == module.train_tokens_seen > 0
    assert (restored.first_train_loss, restored.last_train_loss) == (module.first_train_loss, module.last_train_loss)


def test_the_logged_token_count_stays_exact_past_float32_integers(tmp_path):
    """float32 holds integers exactly up to 2**24 tokens, which a multi-rank run passes in minutes."""
    from lightning.pytorch import Callback, Trainer

    from lit_memtrain.datamodules.sft import SFTDataModule

    class RecordTokens(Callback):
        def __init__(self) -> None:
            self.logged: list[tuple[float, int]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.logged.append((float(trainer.callback_metrics["train/tokens"]), pl_module.train_tokens_seen))

    module = _module(tokenizer="lit-memtrain/embedded")
    module.train_tokens_seen = 2**24 + 1
    record = RecordTokens()
    trainer = Trainer(
        max_steps=3, logger=False, enable_progress_bar=False, callbacks=[record], default_root_dir=tmp_path
    )
    trainer.fit(module, datamodule=SFTDataModule(max_length=32, batch_size=2))
    assert len(record.logged) == 3 and all(seen > 2**24 + 1 for _, seen in record.logged)
    assert [logged for logged, _ in record.logged] == [float(seen) for _, seen in record.logged]


def test_token_counts_go_through_the_strategy_where_torch_distributed_is_not_initialised():
    """XLA's strategy has several ranks but no torch.distributed process group: its own reduce sums the counts."""
    from lit_memtrain.objectives.throughput import summed_over_ranks

    class DoublingStrategy:
        def reduce(self, value: torch.Tensor, reduce_op: str) -> torch.Tensor:
            assert reduce_op == "sum"
            return value * 2

    reduce, cpu = DoublingStrategy().reduce, torch.device("cpu")
    assert not torch.distributed.is_initialized()
    assert int(summed_over_ranks(5, 2, cpu, reduce)) == int(summed_over_ranks(torch.tensor(5), 2, cpu, reduce)) == 10


def _accumulation_run(tmp_path, callbacks=(), **trainer_options):
    """Two micro-batches with 4 and 1 trainable targets, plain SGD with lr 1, and the gradient of their 5-token mean."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    class PlainSGD(CausalLMModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1.0)

    examples = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9]}, {"input_ids": [3, 4, 5], "labels": [-100, -100, 5]}]
    torch.manual_seed(0)
    module = PlainSGD(preset="tiny-qwen3")
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    reference = copy.deepcopy(module)
    reference.compute_loss(PaddedCollator(pad_token_id=0)(examples)).backward()
    first_only = copy.deepcopy(module)
    first_only.compute_loss(PaddedCollator(pad_token_id=0)(examples[:1]), num_items=5).backward()
    loader = DataLoader(examples, batch_size=1, collate_fn=PaddedCollator(pad_token_id=0))
    trainer = Trainer(
        max_steps=1, accumulate_grad_batches=2, callbacks=list(callbacks), logger=False, enable_progress_bar=False,
        default_root_dir=tmp_path, **trainer_options,
    )
    trainer.fit(module, loader)
    update = {n: before[n] - p.detach() for n, p in module.named_parameters()}
    gradient = {n: p.grad for n, p in reference.named_parameters()}
    return update, gradient, {n: p.grad for n, p in first_only.named_parameters()}


def test_each_backward_already_sees_its_share_of_the_step_mean(tmp_path):
    """After the first micro-batch's backward, the gradients are those of its token losses divided by all 5 of the step."""
    from lightning.pytorch import Callback

    class FirstBackward(Callback):
        gradients = None

        def on_after_backward(self, trainer, pl_module):
            if self.gradients is None:
                self.gradients = {n: p.grad.clone() for n, p in pl_module.named_parameters()}

    seen = FirstBackward()
    _, _, first_share = _accumulation_run(tmp_path, callbacks=[seen])
    assert_each_equal_up_to_rounding(seen.gradients, first_share, terms=TINY_MODEL_TERMS)


def test_gradient_clipping_sees_the_norm_of_the_step_mean_gradient(tmp_path):
    torch.manual_seed(0)
    _, gradient, _ = _accumulation_run(tmp_path / "probe")
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in gradient.values()]))
    update, gradient, _ = _accumulation_run(tmp_path, gradient_clip_val=0.5 * norm.item(), gradient_clip_algorithm="norm")
    halved = {name: 0.5 * expected for name, expected in gradient.items()}
    assert_each_equal_up_to_rounding(update, halved, terms=TINY_MODEL_TERMS, scale=1.0)  # the weights' magnitude
