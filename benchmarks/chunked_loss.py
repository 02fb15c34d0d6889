"""Benchmark: time of the chunked loss against the plain loss (full logits), forward and backward, side by side.

Both compute the mean cross-entropy of ``hidden @ weight.T`` over every target and its gradients for hidden
and weight, fp32 on the CPU: ``cross_entropy(F.linear(hidden, weight), targets)`` builds the [N, V] logits;
``chunked_cross_entropy`` never does (its memory is measured in tests/techniques/test_loss.py and
benchmarks/memory_techniques.py). Rounds alternate; the figure is the median over rounds of plain / chunked
process CPU time. Above 1.0x the chunked loss is also faster.

``--entropy`` compares two chunked computations instead: the token log-probabilities that ``GRPOModule`` and
``RLOOModule`` train on, alone (``chunked_token_log_probs``) and with each token's entropy measured in the same
chunks of logits (``chunked_token_log_probs_and_entropies``, what ``train/entropy`` logs); the figure is with /
without: the share of the LM head's forward and backward that the entropy adds.

Run::

    python benchmarks/chunked_loss.py                     # 4096 tokens, hidden 512, vocabulary 32,000
    python benchmarks/chunked_loss.py --vocab 151936      # Qwen3's vocabulary
    python benchmarks/chunked_loss.py --entropy --tokens 2048 --hidden 1024 --vocab 32768 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from lit_memtrain.techniques.logprobs import chunked_token_log_probs, chunked_token_log_probs_and_entropies
from lit_memtrain.techniques.loss import chunked_cross_entropy, cross_entropy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--entropy", action="store_true", help="log-probabilities with and without entropies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,))
    if args.entropy:
        runs = {
            "without": lambda: chunked_token_log_probs(hidden, weight, targets, args.chunk_size).sum(),
            "with": lambda: chunked_token_log_probs_and_entropies(hidden, weight, targets, args.chunk_size)[0].sum(),
        }
    else:
        runs = {
            "plain": lambda: cross_entropy(F.linear(hidden, weight), targets),
            "chunked": lambda: chunked_cross_entropy(hidden, weight, targets, chunk_size=args.chunk_size),
        }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            hidden.grad = weight.grad = None
            start = time.process_time()
            run().backward()
            seconds[name].append(time.process_time() - start)
    first, second = seconds.values()
    ratios = [b / a if args.entropy else a / b for a, b in zip(first, second)]
    print(f"{args.tokens} tokens, hidden {args.hidden}, vocabulary {args.vocab:,}, chunks of {args.chunk_size}")
    for name, values in seconds.items():
        print(f"{name:>8}: {statistics.median(values):.3f} s (forward + backward, median of {args.rounds})")
    label = "with / without entropy" if args.entropy else "plain / chunked"
    print(f"{label}: {statistics.median(ratios):.3f}x (rounds {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
