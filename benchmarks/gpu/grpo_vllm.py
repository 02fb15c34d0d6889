"""GPU check: GRPO's generation backends side by side (Hugging Face ``generate``, continuous batching, vLLM
colocate with sleep mode), on the same model, prompts and weights. Needs vLLM: without it the script stops at its
``import vllm`` and ``check.py`` records the part as skipped, naming the package (pip install 'lit-memtrain[vllm]').

A Qwen3-shaped model (``--preset``, ``--layers`` layers, random bf16 weights) generates ``--prompts`` x
``--num-generations`` completions of ``--max-completion-length`` tokens (no end of sequence: ``eos`` is an id
never drawn by greedy decoding here, so every completion is full length and the backends do the same work):

- per backend: seconds and generated tokens per second of one generation after a warm-up one (ratios to
  ``generate``), and for vLLM the GPU memory free before the engine starts, while it is awake, and after
  ``sleep(level=2)`` (``torch.cuda.mem_get_info``);
- checked: every backend's greedy completions equal ``generate``'s for their first ``--agree-tokens`` tokens (bf16
  kernels differ, so later tokens may diverge after a near tie); vLLM's weights follow the model after an update
  (the model's weights are perturbed, ``weights_version`` raised, and vLLM's completions must change with
  ``generate``'s); sleep gives back at least half of what the engine took.

Run from the repository root (about a minute on one H200, most of it vLLM's start-up)::

    PYTHONPATH=. python benchmarks/gpu/grpo_vllm.py
    PYTHONPATH=. python benchmarks/gpu/grpo_vllm.py --dry-run   # still needs vLLM: vLLM runs on CUDA only
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from lit_memtrain.models.generation import SamplingSettings, TransformersContinuousBatching, TransformersGenerate
from lit_memtrain.models.presets import build_config
from results import add_arguments, check, table, write

GIB = 2**30


def timed(backend, model, prompts, generations, device, version) -> tuple[list[list[int]], float]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    completions = backend.generate(model, prompts, generations, device, version)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return completions, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--agree-tokens", type=int, default=16)
    add_arguments(parser)
    args = parser.parse_args()
    import vllm  # noqa: F401 - the part is skipped, naming the package, where vLLM is not installed

    from lit_memtrain.models.generation import VLLMColocate

    if args.dry_run:
        args.preset, args.layers, args.prompts, args.max_completion_length = "tiny-qwen3", 2, 2, 8
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = build_config(args.preset, {"num_hidden_layers": args.layers})
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").train()
    eos = [config.vocab_size - 1]
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(10, config.vocab_size - 10, (args.prompts, args.prompt_length), generator=generator).tolist()
    greedy = SamplingSettings(max_completion_length=args.max_completion_length, do_sample=False)
    generations = args.num_generations
    backends = {
        "transformers generate": TransformersGenerate(greedy, eos, 0),
        "transformers continuous batching": TransformersContinuousBatching(greedy, eos, 0, page_size=64),
        "vLLM colocate": VLLMColocate(greedy, eos, 0, gpu_memory_utilization=0.3, sleep_level=2,
                                      max_model_len=args.prompt_length + args.max_completion_length,
                                      enforce_eager=args.dry_run),
    }  # fmt: skip
    rows, results, checks = [], {}, []
    free_start = 0
    for name, backend in backends.items():
        if name == "vLLM colocate":  # what the engine takes, not what the backends before it left cached
            torch.cuda.empty_cache()
            free_start = torch.cuda.mem_get_info()[0]
        backend.setup(model)
        timed(backend, model, prompts, generations, device, 0)  # warm-up (vLLM: first weight sync)
        completions, seconds = timed(backend, model, prompts, generations, device, 0)
        results[name] = completions
        generated = sum(len(completion) for completion in completions)  # an eos may end one early
        rows.append([name, round(seconds, 3), round(generated / seconds), 0.0])
    reference = rows[0][1]
    for row in rows:
        row[3] = round(reference / row[1], 2)
    engine = backends["vLLM colocate"]
    engine.llm.wake_up()
    awake = torch.cuda.mem_get_info()[0]
    engine.llm.sleep(level=2)
    asleep = torch.cuda.mem_get_info()[0]
    taken = free_start - awake
    checks.append(check("sleep gives back the engine's memory", free_start - asleep <= taken / 2,
                        f"free {free_start / GIB:.1f} GiB before, {awake / GIB:.1f} awake, {asleep / GIB:.1f} asleep"))
    expected = [c[: args.agree_tokens] for c in results["transformers generate"]]
    for name in ("transformers continuous batching", "vLLM colocate"):
        agree = sum(c[: args.agree_tokens] == e for c, e in zip(results[name], expected))
        checks.append(check(f"{name}: greedy completions agree with generate", agree >= 0.9 * len(expected),
                            f"{agree} of {len(expected)} agree on their first {args.agree_tokens} tokens"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    updated_hf = backends["transformers generate"].generate(model, prompts, 1, device, 1)
    updated_vllm = engine.generate(model, prompts, 1, device, 1)
    moved = sum(a[: args.agree_tokens] == b[: args.agree_tokens] for a, b in zip(updated_vllm, updated_hf))
    checks.append(check("vLLM follows the trained weights after an update", moved >= 0.9 * len(updated_hf),
                        f"{moved} of {len(updated_hf)} completions agree with generate on the updated weights"))
    summary = (f"{args.preset} ({args.layers} layers, bf16): {args.prompts} prompts x {generations} completions of "
               f"{args.max_completion_length} tokens")  # fmt: skip
    print(summary)
    for row in rows:
        print(row)
    for item in checks:
        print(item)
    passed = write(args.json, summary=summary, checks=checks, config=vars(args) | {"json": str(args.json)},
                   tables=[table("generation backends", ["backend", "seconds", "tokens/s", "speed-up vs generate"],
                                 rows)])  # fmt: skip
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
