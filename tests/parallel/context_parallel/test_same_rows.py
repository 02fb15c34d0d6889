"""Every rank of a context-parallel group must get the same rows: ranks given different rows (a dataset split by
global rank) would otherwise train on a row stitched from several, silently when the lengths agree."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_memtrain.parallel.context_parallel import check_same_rows


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    outcomes = []
    try:
        for seeds in ((0, 0), (0, 1)):  # the same rows; then rows of the same shape that differ
            try:
                check_same_rows(_batch(seeds[rank]), dist.group.WORLD)
                outcomes.append("ok")
            except ValueError as error:
                outcomes.append(str(error))
    finally:
        dist.destroy_process_group()
    queue.put((rank, outcomes))


def test_ranks_given_different_rows_fail_on_every_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_worker, args=(rank, port, queue)) for rank in range(2)]
    for process in processes:
        process.start()
    results = dict(queue.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    for rank in range(2):
        assert results[rank][0] == "ok"
        assert "ranks of a context-parallel group got different batches" in results[rank][1]
        assert "never over the global rank" in results[rank][1]

