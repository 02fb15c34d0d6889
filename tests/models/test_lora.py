import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from lightning.pytorch import Trainer
from transformers import AutoModelForCausalLM

from lit_memtrain.cli import main
from lit_memtrain.datamodules.sft import SFTDataModule
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.objectives.causal_lm import CausalLMModule


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tokenizer):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    module = CausalLMModule(preset="tiny-qwen3", tokenizer="lit-memtrain/embedded")
    module.configure_model()
    module.export(path)
    return str(path)


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def test_lora_fit_changes_only_adapter_weights_and_export_merges(base_dir, tmp_path):
    lora = LoraSettings(r=4, alpha=8, lm_head=True)
    module = CausalLMModule(model=base_dir, tokenizer="lit-memtrain/embedded", lora=lora, learning_rate=1e-2)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = Trainer(max_steps=3, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, datamodule=SFTDataModule(max_length=48, batch_size=4))
    changed = {n for n, p in module.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lm_head.lora_B" in n for n in changed)

    ckpt = tmp_path / "adapter.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    assert saved and all("lora_" in k for k in saved)

    main(["export", "--checkpoint", str(ckpt), "--output", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    batch = _batch(merged.config.vocab_size)
    module.model.eval()
    with torch.no_grad():
        expected = module.model(batch["input_ids"]).logits
        assert_equal_up_to_rounding(merged(batch["input_ids"]).logits, expected, name="logits", terms=TINY_MODEL_TERMS)


def test_chunked_loss_with_lora_head_matches_plain_loss(base_dir):
    lora = LoraSettings(r=4, alpha=8, lm_head=True)
    torch.manual_seed(0)
    chunked = CausalLMModule(model=base_dir, lora=lora, loss_type="chunked", loss_chunk_size=7)
    chunked.configure_model()
    torch.manual_seed(0)
    plain = CausalLMModule(model=base_dir, lora=lora, loss_type="nll")
    plain.configure_model()
    for module in (chunked, plain):  # LoRA B starts at zero: give it values so the head adapter matters
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(hash(name) % 1000), std=0.02)
    batch = _batch(chunked.model.config.vocab_size)
    loss_c, loss_p = chunked.compute_loss(batch), plain.compute_loss(batch)
    loss_c.backward()
    loss_p.backward()
    assert_equal_up_to_rounding(loss_c, loss_p, name="loss", terms=TINY_MODEL_TERMS)
    grads_p = dict(plain.model.named_parameters())
    for name, p in chunked.model.named_parameters():
        if p.requires_grad:
            assert_equal_up_to_rounding(p.grad, grads_p[name].grad, name=name, terms=TINY_MODEL_TERMS)


def test_lora_settings_are_validated():
    with pytest.raises(ValueError, match="r >= 1"):
        LoraSettings(r=0)
    with pytest.raises(ValueError, match="quantizes a checkpoint while loading"):
        CausalLMModule(preset="tiny-qwen3", lora=LoraSettings(quantize="4bit"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_qlora_without_cuda_is_a_clear_error(base_dir):
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CausalLMModule(model=base_dir, lora=LoraSettings(quantize="4bit"))


def test_lora_with_every_memory_technique_matches_plain_lora(base_dir):
    from lit_memtrain.techniques.checkpointing import apply_checkpointing
    from lit_memtrain.models.layers import find_decoder_layers
    from lit_memtrain.techniques.offload import ActivationOffloader
    from lit_memtrain.techniques.tiled_mlp import apply_tiled_mlp

    lora = LoraSettings(r=4, alpha=8, lm_head=True)
    modules = []
    for loss_type in ("nll", "chunked"):
        torch.manual_seed(0)
        module = CausalLMModule(model=base_dir, lora=lora, loss_type=loss_type, loss_chunk_size=5)
        module.configure_model()
        for name, p in module.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(len(name)), std=0.02)
        modules.append(module)
    plain, tuned = modules
    layers = find_decoder_layers(tuned)
    apply_checkpointing(layers, selective=True)
    apply_tiled_mlp(layers, num_tiles=3)
    batch = _batch(plain.model.config.vocab_size)
    plain.compute_loss(batch).backward()
    offloader = ActivationOffloader(tuned, offload_cpu_tensors_for_testing=True, min_offload_bytes=0, max_fwd_stash_size=0)
    with offloader:
        loss = tuned.compute_loss(batch)
        loss.backward()
    assert offloader.stats.tensors == len(layers)  # one checkpointed input per layer went to host memory
    assert_equal_up_to_rounding(loss, plain.compute_loss(batch), name="loss", terms=TINY_MODEL_TERMS)
    expected = dict(plain.model.named_parameters())
    for name, p in tuned.model.named_parameters():
        if p.requires_grad:
            assert_equal_up_to_rounding(p.grad, expected[name].grad, name=name, terms=TINY_MODEL_TERMS)


YARN = {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0, "original_max_position_embeddings": 512}


def _randomise_adapters(model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(len(name)), std=0.02)


def test_yarn_lora_export_keeps_rope_parameters_and_reloads_to_the_same_logits(base_dir, tmp_path):
    import json

    module = CausalLMModule(
        model=base_dir, tokenizer="lit-memtrain/embedded", lora=LoraSettings(r=4, alpha=8, lm_head=True),
        model_init_kwargs={"rope_parameters": YARN},
    )
    module.configure_model()
    _randomise_adapters(module.model)
    path = module.export(tmp_path / "merged")
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    assert reloaded.model.rotary_emb.rope_type == "yarn"
    ids = _batch(reloaded.config.vocab_size)["input_ids"]
    module.model.eval()
    with torch.no_grad():
        expected = module.model(ids).logits
        assert_equal_up_to_rounding(reloaded(ids).logits, expected, name="logits", terms=TINY_MODEL_TERMS)


def test_the_lora_merge_copies_tensors_to_host_memory_and_leaves_the_training_model_untouched(base_dir, monkeypatch):
    from lit_memtrain.models.lora import merged_copy

    module = CausalLMModule(model=base_dir, lora=LoraSettings(r=4, alpha=8, lm_head=True))
    module.configure_model()
    _randomise_adapters(module.model)
    before = {name: p.detach().clone() for name, p in module.model.named_parameters()}

    def cloned_on_its_device(self, memo):
        raise AssertionError("a tensor of the training model was deep-copied on its own device")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", cloned_on_its_device)
    monkeypatch.setattr(torch.nn.Parameter, "__deepcopy__", cloned_on_its_device)
    merged = merged_copy(module.model)
    monkeypatch.undo()
    assert all(p.device.type == "cpu" for p in merged.parameters())
    training = {p.untyped_storage().data_ptr() for p in module.model.parameters()}
    assert not training & {p.untyped_storage().data_ptr() for p in merged.parameters()}
    for name, p in module.model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_qlora_export_reloads_the_base_with_the_runs_init_kwargs_dtype_and_trust_remote_code(base_dir, tmp_path, monkeypatch):
    """The QLoRA path (CUDA only for training) with its quantized check skipped: the base is reloaded unquantized
    with what the run was built with, and the adapter merged into it."""
    import json

    import lit_memtrain.models.builder as model_builder
    from lit_memtrain.models.builder import ModelRecipe, export_hf_directory

    monkeypatch.setattr(model_builder, "check_quantization_available", lambda settings: None)
    reloads = []
    from_pretrained = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(
        AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: reloads.append(kwargs) or from_pretrained(*args, **kwargs)
    )
    lora = LoraSettings(r=4, alpha=8, quantize="4bit")
    recipe = ModelRecipe(model=base_dir, dtype="bfloat16", model_init_kwargs={"rope_parameters": YARN}, lora=lora)
    trained = CausalLMModule(model=base_dir, lora=LoraSettings(r=4, alpha=8), model_init_kwargs={"rope_parameters": YARN})
    trained.configure_model()  # stands in for the 4-bit model: same adapter layout
    _randomise_adapters(trained.model)
    path = export_hf_directory(trained.model, recipe, tmp_path / "merged")
    assert reloads[-1]["trust_remote_code"] is False and reloads[-1]["dtype"] == torch.bfloat16
    assert "quantization_config" not in reloads[-1]
    config = json.loads((path / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = _batch(reloaded.config.vocab_size)["input_ids"]
    trained.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, trained.model(ids).logits, rtol=0.05, atol=0.05)
    # The logits of a bf16 export are close, not equal: the merged update itself is checked too. What each adapted
    # weight gained over the bf16 base is its adapter's scaling * B @ A (bf16 rounding aside: the fitted scale is 1).
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16).state_dict()
    merged = reloaded.state_dict()
    gained, updates = [], []
    for name, module in trained.model.named_modules():
        if "default" in getattr(module, "lora_A", {}):
            weight = name.removeprefix("base_model.model.") + ".weight"
            gained.append(merged[weight] - base[weight].float())
            updates.append(module.get_delta_weight("default").detach())
    assert len(updates) == 2 * 7  # q, k, v, o, gate, up and down of the two layers
    fitted_scale = sum((g * u).sum() for g, u in zip(gained, updates)) / sum((u * u).sum() for u in updates)
    assert float(fitted_scale) == pytest.approx(1.0, abs=0.01)
