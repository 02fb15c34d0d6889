"""The generation backends other than Hugging Face ``generate``, chosen by one argument of GRPOModule.

vLLM is not installed here (and needs a CUDA machine), so the two vLLM backends are tested against fakes that
check what vLLM's documented API would be asked: a fake ``vllm`` module in ``sys.modules`` (an ``LLM`` whose
weights are dropped while asleep at level 2 and whose generation refuses to run asleep; ``SamplingParams`` taking
only vLLM's documented fields) and a fake ``vllm serve`` over HTTP with the endpoints TRL's ``VLLMClient`` uses.
Both fakes generate greedily with a Hugging Face model holding the weights they were sent, so a GRPO run with them
must train exactly as one with ``generate``: that checks the weights are synced after every optimizer step, LoRA
merged, and the completions come back in order. Continuous batching runs for real (transformers, CPU).
"""

from __future__ import annotations

import copy
import json
import queue
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from equivalence import TINY_MODEL_TERMS, assert_equal_up_to_rounding
from transformers import AutoConfig, AutoModelForCausalLM

from lit_memtrain.models.generation import (
    BACKENDS,
    SamplingSettings,
    TransformersContinuousBatching,
    TransformersGenerate,
    VLLMColocate,
    VLLMServer,
    cut_after_eos,
)
from lit_memtrain.models.generation import vllm_server as vllm_server_module
from lit_memtrain.models.generation.vllm_common import vllm_requests, vllm_sampling_params
from lit_memtrain.models.generation.weight_sync import inference_weights, materialized
from lit_memtrain.models.lora import LoraSettings
from lit_memtrain.models.presets import build_config

CPU = torch.device("cpu")
OVERRIDES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
# vLLM's documented SamplingParams fields (docs.vllm.ai, vllm.SamplingParams) and the LLM arguments used here.
SAMPLING_FIELDS = {"n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
                   "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
                   "prompt_logprobs", "detokenize", "skip_special_tokens"}
LLM_ARGUMENTS = {"model", "load_format", "skip_tokenizer_init", "tensor_parallel_size", "distributed_executor_backend",
                 "enable_sleep_mode", "seed", "max_num_batched_tokens", "gpu_memory_utilization", "max_model_len",
                 "max_num_seqs", "dtype", "enforce_eager", "logprobs_mode"}


def _greedy(model, prompts, params) -> list[list[int]]:
    """What vLLM draws greedily (temperature 0): Hugging Face ``generate``, stopped at ``stop_token_ids``."""
    settings = SamplingSettings(max_completion_length=params["max_tokens"], do_sample=False,
                                repetition_penalty=params["repetition_penalty"])
    backend = TransformersGenerate(settings, params["stop_token_ids"], 0)
    return [c for ids in prompts for c in backend.generate(model, [ids], params["n"], CPU, 0)]


def _sampled_logprobs(model, prompts, n, completions) -> list[list[float]]:
    """The log-probability the engine reports for each completion token (``logprobs=0``): its model's."""
    values = []
    for index, completion in enumerate(completions):
        prompt = prompts[index // n]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        values.append(logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0].tolist())
    return values


class FakeEngine:
    """The engine's model: a Hugging Face model built from the config directory vLLM is given, random weights."""

    def __init__(self, directory: str) -> None:
        torch.manual_seed(123)
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).eval()
        self.loaded: list[str] = []

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            with torch.no_grad():
                self.model.get_parameter(name).copy_(tensor)
            self.loaded.append(name)

    def drop_weights(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.fill_(float("nan"))


def fake_vllm_module(calls: list) -> types.ModuleType:
    """A ``vllm`` module with vLLM's documented ``LLM`` / ``SamplingParams`` surface, recording every call."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.30.0"

    class SamplingParams:
        def __init__(self, **kwargs) -> None:
            unknown = set(kwargs) - SAMPLING_FIELDS
            assert not unknown, f"not SamplingParams fields: {unknown}"
            self.kwargs = kwargs

    class LLM:
        def __init__(self, **kwargs) -> None:
            assert set(kwargs) <= LLM_ARGUMENTS, set(kwargs) - LLM_ARGUMENTS
            calls.append(("LLM", kwargs))
            self.engine = FakeEngine(kwargs["model"])
            runner = types.SimpleNamespace(model=self.engine)
            self.llm_engine = types.SimpleNamespace(
                model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)))
            self.awake = {"weights", "kv_cache"}
            self.engine.load_weights = self._checked_load(self.engine.load_weights)

        def _checked_load(self, load):
            def checked(weights):
                assert "weights" in self.awake, "load_weights while the weights sleep"
                calls.append(("load_weights", [name for name, _ in weights]))
                load(weights)
            return checked

        def sleep(self, level: int) -> None:
            calls.append(("sleep", level))
            self.awake.clear()
            if level == 2:
                self.engine.drop_weights()

        def wake_up(self, tags=None) -> None:
            calls.append(("wake_up", tuple(tags)))
            self.awake |= set(tags)

        def reset_prefix_cache(self) -> None:
            calls.append(("reset_prefix_cache",))

        def generate(self, prompts, sampling_params, use_tqdm=True):
            assert self.awake == {"weights", "kv_cache"}, f"generate while asleep: awake {self.awake}"
            params = sampling_params.kwargs
            calls.append(("generate", params))
            ids = [p["prompt_token_ids"] for p in prompts]
            flat = _greedy(self.engine.model, ids, params)
            n = params["n"]
            assert sampling_params.kwargs["logprobs"] == 0  # the sampled tokens' only
            logprobs = _sampled_logprobs(self.engine.model, ids, n, flat)

            def sample(k: int):
                entries = [{token: types.SimpleNamespace(logprob=value)} for token, value in zip(flat[k], logprobs[k])]
                return types.SimpleNamespace(index=k % n, token_ids=flat[k], logprobs=entries)

            return [types.SimpleNamespace(outputs=[sample(p * n + i) for i in reversed(range(n))])
                    for p in range(len(ids))]

    module.LLM, module.SamplingParams = LLM, SamplingParams
    return module


@pytest.fixture
def fake_vllm(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm_module(calls))
    # vLLM's launcher reads them and the colocated engine sets them, as TRL's does: set and then removed here, so that
    # monkeypatch removes them again after the test (a later Trainer in this process would start a process group).
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return calls


@pytest.fixture
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(build_config("tiny-qwen3", {**OVERRIDES, "vocab_size": 384,
                                                                        "initializer_range": 0.5})).train()


# --------------------------------------------------------------------------------------------- sampling, one meaning


def test_generation_kwargs_reach_every_backend_but_not_what_the_settings_own(model):
    """TRL's generation_kwargs: passed on as they are (here suppress_tokens, which changes the greedy completion)."""
    from dataclasses import replace

    greedy = SamplingSettings(max_completion_length=4, do_sample=False)
    plain = TransformersGenerate(greedy, [2], 0).generate(model, [[5, 6, 7]], 1, CPU, 0)[0]
    suppressed = replace(greedy, generation_kwargs={"suppress_tokens": [plain[0]]})
    assert plain[0] not in TransformersGenerate(suppressed, [2], 0).generate(model, [[5, 6, 7]], 1, CPU, 0)[0]
    assert TransformersContinuousBatching(suppressed, [2], 0).generation_config(1).suppress_tokens == [plain[0]]
    penalized = replace(greedy, generation_kwargs={"presence_penalty": 0.5})
    assert vllm_sampling_params(penalized, [2], 1) == {**vllm_sampling_params(greedy, [2], 1), "presence_penalty": 0.5}
    with pytest.raises(ValueError, match=r"generation_kwargs may not set \['max_tokens', 'temperature'\]"):
        SamplingSettings(generation_kwargs={"temperature": 0.5, "max_tokens": 3})


def test_sampling_settings_mean_the_same_on_every_backend():
    sampled = SamplingSettings(max_completion_length=7, temperature=0.7, top_p=0.9, top_k=20, min_p=None,
                               repetition_penalty=1.1)
    hf = TransformersGenerate(sampled, [2, 5], 0).generate_kwargs()
    vllm = vllm_sampling_params(sampled, [2, 5], 4)
    cb = TransformersContinuousBatching(replace_penalty(sampled), [2, 5], 0).generation_config(4)
    assert (hf["max_new_tokens"], vllm["max_tokens"], cb.max_new_tokens) == (7, 7, 7)
    for name in ("temperature", "top_p", "top_k"):
        assert hf[name] == vllm[name] == getattr(cb, name) == getattr(sampled, name), name
    assert hf["repetition_penalty"] == vllm["repetition_penalty"] == 1.1
    assert hf["min_p"] is None and vllm["min_p"] == 0.0  # off on both
    assert hf["eos_token_id"] == vllm["stop_token_ids"] == cb.eos_token_id == [2, 5] and vllm["ignore_eos"]
    assert (hf["do_sample"], cb.do_sample, cb.num_return_sequences) == (True, True, 4)
    greedy = SamplingSettings(max_completion_length=7, do_sample=False, min_p=0.1, top_k=5)
    assert vllm_sampling_params(greedy, [2], 1) == {
        "n": 1, "max_tokens": 7, "repetition_penalty": 1.0, "stop_token_ids": [2], "ignore_eos": True,
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
    assert TransformersGenerate(greedy, [2], 0).generate_kwargs()["do_sample"] is False
    assert vllm_requests([[5], [6, 7]], 3, greedy) == ([[5], [5], [5], [6, 7], [6, 7], [6, 7]], 1)  # vLLM: n=1 greedy
    assert vllm_requests([[5], [6, 7]], 3, sampled) == ([[5], [6, 7]], 3)
    with_min_p = SamplingSettings(min_p=0.05, top_k=10)
    assert vllm_sampling_params(with_min_p, [2], 2)["min_p"] == 0.05


def replace_penalty(settings: SamplingSettings) -> SamplingSettings:
    from dataclasses import replace

    return replace(settings, repetition_penalty=1.0)


def test_settings_a_backend_would_draw_differently_are_refused_with_the_way_out():
    for settings, match in [(SamplingSettings(min_p=0.1, top_p=0.9), "vLLM applies min_p before top_p"),
                            (SamplingSettings(temperature=2.5), r"temperatures in \[0.01, 2.0\]"),
                            (SamplingSettings(temperature=0.005), r"temperatures in \[0.01, 2.0\]")]:
        for backend in (VLLMColocate, VLLMServer):
            with pytest.raises(ValueError, match=match):
                backend.check_sampling(settings)
    with pytest.raises(ValueError, match="continuous batching drops the repetition penalty"):
        TransformersContinuousBatching.check_sampling(SamplingSettings(repetition_penalty=1.2))
    TransformersGenerate.check_sampling(SamplingSettings(min_p=0.1, top_p=0.9, repetition_penalty=1.2))


# --------------------------------------------------------------------------------------------- continuous batching


def test_continuous_batching_gives_generates_greedy_completions(model):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42]]
    greedy = SamplingSettings(max_completion_length=8, do_sample=False)
    expected = TransformersGenerate(greedy, [2], 0).generate(model, prompts, 2, CPU, 0)
    eos = expected[0][3]  # an end of sequence inside the first completion: it must stop there, kept
    expected = [cut_after_eos(c, [2, eos], 8) for c in expected]
    backend = BACKENDS["transformers_continuous"](greedy, [2, eos], 0, page_size=16)
    attention = model.config._attn_implementation
    assert backend.generate(model, prompts, 2, CPU, 0) == expected
    assert len(expected[0]) == 4 and model.training and model.config._attn_implementation == attention
    sampled = BACKENDS["transformers_continuous"](SamplingSettings(max_completion_length=5, top_k=50), [2], 0)
    completions = sampled.generate(model, prompts, 3, CPU, 0)
    assert len(completions) == 9 and all(1 <= len(c) <= 5 for c in completions)


# --------------------------------------------------------------------------------------------- vLLM, missing


def test_without_vllm_the_vllm_backends_fail_at_once_saying_what_to_install(monkeypatch):
    from lit_memtrain.objectives.grpo import GRPOModule

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    built = []
    monkeypatch.setattr(GRPOModule, "configure_model", lambda self: built.append(self))
    for name in ("vllm_colocate", "vllm_server"):
        with pytest.raises(ImportError, match=r"need vLLM, which is not installed: pip install 'lit-memtrain\[vllm\]'"):
            GRPOModule(preset="tiny-qwen3", tokenizer="no/such-tokenizer-is-loaded", reward_funcs=[len],
                       generation_backend=name)
    assert not built
    with pytest.raises(ImportError, match="lit-memtrain\\[vllm\\]"):
        VLLMColocate(SamplingSettings(), [2], 0)


def test_backend_options_are_checked_by_name_before_any_work(fake_vllm):
    from lit_memtrain.objectives.grpo import GRPOModule

    with pytest.raises(ValueError, match=r"\['gpu_memory'\] are not options of VLLMColocate; its options are "
                                         r"\['gpu_memory_utilization'"):
        GRPOModule(preset="tiny-qwen3", tokenizer="x", reward_funcs=[len], generation_backend="vllm_colocate",
                   generation_options={"gpu_memory": 0.5})
    with pytest.raises(ValueError, match="vLLM applies min_p before top_p"):
        GRPOModule(preset="tiny-qwen3", tokenizer="x", reward_funcs=[len], generation_backend="vllm_server",
                   min_p=0.1, top_p=0.9)
    with pytest.raises(ValueError, match="sleep_level must be 1, 2 or None"):
        VLLMColocate(SamplingSettings(), [2], 0, sleep_level=3)
    assert not fake_vllm  # no engine was started


# --------------------------------------------------------------------------------------------- vLLM colocate


def test_colocate_sleeps_between_generations_and_syncs_weights_before_each(fake_vllm, model):
    settings = SamplingSettings(max_completion_length=6, do_sample=False)
    expected = TransformersGenerate(settings, [2], 0).generate(model, [[5, 6, 7], [9]], 2, CPU, 0)
    backend = BACKENDS["vllm_colocate"](settings, [2], 0, sleep_level=2, max_model_len=64)
    backend.setup(model)
    assert backend.generate(model, [[5, 6, 7], [9]], 2, CPU, 0) == expected
    names = [w.name for w in inference_weights(model)]
    kinds = [call[0] for call in fake_vllm]
    assert kinds[:2] == ["LLM", "sleep"] and fake_vllm[1] == ("sleep", 2)
    assert fake_vllm[0][1]["enable_sleep_mode"] and fake_vllm[0][1]["load_format"] == "dummy"
    first = kinds[2:]  # wake the weights, load every one, reset the cache, wake the KV cache, generate, sleep
    assert first == ["wake_up"] + ["load_weights"] * len(names) + ["reset_prefix_cache", "wake_up", "generate", "sleep"]
    assert fake_vllm[2] == ("wake_up", ("weights",)) and fake_vllm[-3] == ("wake_up", ("kv_cache",))
    assert [c[1][0] for c in fake_vllm if c[0] == "load_weights"] == names
    assert fake_vllm[-2][1] == {**vllm_sampling_params(settings, [2], 1), "detokenize": False, "logprobs": 0}
    sent = [[5, 6, 7], [5, 6, 7], [9], [9]]  # greedy: each prompt num_generations times, n = 1
    assert backend.sampling_logprobs == _sampled_logprobs(model, sent, 1, expected)  # the engine holds its weights
    fake_vllm.clear()  # level 2 dropped the weights: the next generation sends them again, same version or not
    assert backend.generate(model, [[5, 6, 7], [9]], 2, CPU, 0) == expected
    assert sum(c[0] == "load_weights" for c in fake_vllm) == len(names)


def test_colocate_without_dropping_weights_sends_them_only_when_they_changed(fake_vllm, model):
    settings = SamplingSettings(max_completion_length=4, do_sample=False)
    for level in (1, None):
        fake_vllm.clear()
        backend = VLLMColocate(settings, [2], 0, sleep_level=level)
        for version in (0, 0, 1):
            backend.generate(model, [[5, 6]], 2, CPU, version)
        loads = sum(c[0] == "load_weights" for c in fake_vllm)
        assert loads == 2 * len(inference_weights(model)), level
        assert ("sleep", 1) in fake_vllm if level == 1 else not any(c[0] in ("sleep", "wake_up") for c in fake_vllm)


def test_lora_is_merged_for_the_engine_and_the_model_left_as_it_was(model):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    before = {n: p.clone() for n, p in peft_model.named_parameters()}
    sent = {w.name: w.materialize(CPU) for w in inference_weights(peft_model)}
    reference = copy.deepcopy(peft_model).merge_and_unload()  # PEFT's own merge, on a copy
    assert sent.keys() == dict(reference.named_parameters()).keys()
    for name, tensor in reference.named_parameters():  # W + scaling x B @ A: a sum over rank 4, and W
        assert_equal_up_to_rounding(sent[name], tensor, name=name, terms=4 + 1)
    assert all(torch.equal(p, before[n]) for n, p in peft_model.named_parameters())



def test_fused_experts_are_sent_as_the_checkpoint_tensors_they_split_into(tmp_path):
    """transformers 5 holds a MoE layer's experts as 3-D tensors (mlp.experts.gate_up_proj) that no checkpoint names
    and vLLM's load_weights refuses: every tensor sent must be one of save_pretrained's, under its name."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig

    torch.manual_seed(0)
    config = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, vocab_size=128)  # fmt: skip
    moe = AutoModelForCausalLM.from_config(config)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(moe.named_parameters())
    moe.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    weights = inference_weights(moe)
    assert {w.name: w.shape for w in weights} == {name: tuple(t.shape) for name, t in checkpoint.items()}
    sent = dict(materialized(weights, CPU))
    assert sent.keys() == checkpoint.keys() and all(torch.equal(sent[n], checkpoint[n]) for n in checkpoint)
    piece = next(w for w in weights if w.name == "model.layers.1.mlp.experts.2.up_proj.weight")
    assert torch.equal(piece.materialize(CPU), checkpoint[piece.name])  # one piece alone, as a colocated engine asks


# --------------------------------------------------------------------------------------------- vLLM server


class FakeServer:
    """``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` and an NCCL weight-transfer engine, as TRL's client sees it."""

    def __init__(self, directory: str) -> None:
        self.engine = FakeEngine(directory)
        self.requests: list[tuple[str, dict | None]] = []
        self.arrivals: queue.Queue = queue.Queue()
        self.logprobs_mode = "processed_logprobs"  # what TRL's vllm-serve starts it with
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, body) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake.requests.append((self.path, None))
                config = {"weight_transfer_config": {"backend": "nccl"},
                          "model_config": {"logprobs_mode": fake.logprobs_mode}}
                answers = {"/health": {}, "/v1/models": {"data": [{"id": "served"}]}, "/get_world_size": {"world_size": 1},
                           "/server_info?config_format=json": {"vllm_config": config}}
                self._answer(answers[self.path])

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                fake.requests.append((self.path, body))
                if self.path == "/update_weights":
                    info = body["update_info"]
                    tensors = fake.arrivals.get(timeout=30)
                    assert [n for n, _ in tensors] == info["names"]
                    assert [list(t.shape) for _, t in tensors] == info["shapes"]
                    assert [str(t.dtype).removeprefix("torch.") for _, t in tensors] == info["dtype_names"]
                    fake.engine.load_weights(tensors)
                if self.path == "/v1/completions":
                    params = {k: body[k] for k in ("n", "max_tokens", "repetition_penalty", "stop_token_ids")}
                    flat = _greedy(fake.engine.model, body["prompt"], params)
                    logprobs = _sampled_logprobs(fake.engine.model, body["prompt"], body["n"], flat)
                    assert body["logprobs"] == 0
                    order = reversed(range(len(flat)))  # answered out of order: the client sorts by index
                    return self._answer({"choices": [{"index": i, "token_ids": flat[i], "logprobs": {
                        "tokens": [str(t) for t in flat[i]], "token_logprobs": logprobs[i], "top_logprobs": None}}
                        for i in order]})  # fmt: skip
                self._answer({})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"


@pytest.fixture
def fake_server(fake_vllm, tmp_path, monkeypatch):
    directory = tmp_path / "served"
    build_config("tiny-qwen3", {**OVERRIDES, "vocab_size": 384, "initializer_range": 0.5}).save_pretrained(directory)
    server = FakeServer(str(directory))

    class Transport:
        def address(self) -> str:
            return "127.0.0.1"

        def open(self, init_info) -> None:
            server.requests.append(("nccl-open", init_info))

        def send(self, tensors) -> None:
            server.arrivals.put([(name, tensor.clone()) for name, tensor in tensors])

    monkeypatch.setattr(vllm_server_module, "NcclWeightTransport", Transport)
    yield server
    server.http.shutdown()


def test_server_pushes_weights_when_they_change_and_asks_with_the_same_sampling(fake_server, model):
    settings = SamplingSettings(max_completion_length=6, do_sample=False)
    expected = TransformersGenerate(settings, [2], 0).generate(model, [[5, 6, 7], [9]], 2, CPU, 0)
    backend = BACKENDS["vllm_server"](settings, [2], 0, base_url=fake_server.url, connection_timeout=5)
    for version in (0, 0, 1):
        assert backend.generate(model, [[5, 6, 7], [9]], 2, CPU, version) == expected
    paths = [path for path, _ in fake_server.requests]
    setup = ["/health", "/v1/models", "/server_info?config_format=json", "/get_world_size"]
    push = ["/start_weight_update", "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]
    assert paths[:4] == setup and set(paths[4:6]) == {"/init_weight_transfer_engine", "nccl-open"}
    assert paths[6:] == push + ["/v1/completions"] * 2 + push + ["/v1/completions"]
    completion = next(body for path, body in fake_server.requests if path == "/v1/completions")
    assert completion == {"model": "served", "prompt": [[5, 6, 7]] * 2 + [[9]] * 2, "return_token_ids": True,
                          "logprobs": 0, **vllm_sampling_params(settings, [2], 1)}
    assert backend.sampling_logprobs == _sampled_logprobs(model, completion["prompt"], 1, expected)
    info = next(body for path, body in fake_server.requests if path == "nccl-open")
    assert info == {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2,
                         "packed": True}


def test_an_unreachable_server_names_the_command_that_starts_it(fake_vllm, model):
    backend = VLLMServer(SamplingSettings(), [2], 0, base_url="http://127.0.0.1:9", connection_timeout=0.1)
    with pytest.raises(ConnectionError, match=r"No vLLM server answered at http://127.0.0.1:9 .* VLLM_SERVER_DEV_MODE=1 "
                                              r"vllm serve <model> --weight-transfer-config"):
        backend.setup(model)


def test_a_server_reporting_raw_log_probabilities_is_warned_of_as_trl_warns(fake_server, model, recwarn):
    fake_server.logprobs_mode = "raw_logprobs"
    VLLMServer(SamplingSettings(), [2], 0, base_url=fake_server.url, connection_timeout=5).setup(model)
    assert [str(w.message) for w in recwarn if "logprobs-mode" in str(w.message)] == [
        f"The vLLM server at {fake_server.url} runs with --logprobs-mode raw_logprobs: the log-probabilities it "
        "reports are not those it sampled with, which biases the importance-sampling correction. Restart it with "
        "--logprobs-mode processed_logprobs, or set vllm_importance_sampling_correction=False."
    ]


# --------------------------------------------------------------------------------------------- through GRPO fits


_REFERENCE_RUN: dict[str, dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("backend", ["vllm_colocate", "vllm_server", "transformers_continuous"])
def test_a_grpo_run_trains_the_same_on_every_backend(backend, request, tmp_path):
    """Greedy completions (every backend draws the same ones): a LoRA policy trained two optimizer steps on each
    backend ends with the weights of the run on ``generate``, so the engines got the trained, merged weights."""
    import datasets
    from lightning.pytorch import Trainer

    from lit_memtrain.datamodules.prompts import PromptDataModule
    from lit_memtrain.objectives.grpo import GRPOModule

    options = {}
    if backend.startswith("vllm"):
        request.getfixturevalue("fake_vllm")
    if backend == "vllm_server":
        options = {"base_url": request.getfixturevalue("fake_server").url}
    prompts = datasets.Dataset.from_list([{"prompt": f"{i} plus {i + 1} is"} for i in range(4)])

    def token_sum(completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    def run(name: str, generation_options: dict) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        module = GRPOModule(preset="tiny-qwen3", config_overrides={**OVERRIDES, "initializer_range": 0.3},
                            tokenizer="lit-memtrain/embedded", reward_funcs=[token_sum], num_generations=2,
                            max_completion_length=5, do_sample=False, learning_rate=5e-2, warmup=0, min_lr_ratio=1.0,
                            lora=LoraSettings(r=4, alpha=8), generation_backend=name,
                            generation_options=generation_options)
        trainer = Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, batch_size=2, seed=0))
        return {n: p.detach().clone() for n, p in module.model.named_parameters() if "lora_" in n}

    if backend == "vllm_server":  # the served model must have the trained model's architecture and vocabulary
        config = build_config("tiny-qwen3", {**OVERRIDES, "initializer_range": 0.3})
        config.save_pretrained(tmp_path / "served")
        server = request.getfixturevalue("fake_server")
        server.engine = FakeEngine(str(tmp_path / "served"))
    if "transformers" not in _REFERENCE_RUN:  # the run on generate, once for the three backends
        _REFERENCE_RUN["transformers"] = run("transformers", {})
    expected = _REFERENCE_RUN["transformers"]
    trained = run(backend, options)
    assert trained.keys() == expected.keys()
    for name, tensor in expected.items():
        assert_equal_up_to_rounding(trained[name], tensor, name=name, terms=TINY_MODEL_TERMS)
