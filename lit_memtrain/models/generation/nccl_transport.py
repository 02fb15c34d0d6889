"""The trainer's end of vLLM's NCCL weight-transfer engine: how a ``vllm serve`` server gets the trained weights.

Why a class of its own: it is the only part of the server backend that needs vLLM and a CUDA device in the
training process (TRL 1.16's ``VLLMClient.init_communicator`` / ``update_named_params`` against vLLM >= 0.28,
whose stateful engine moved ``packed`` into the group's init info); the HTTP protocol around it is plain
requests, so a test can replace this class alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from lit_memtrain.models.generation.vllm_common import require_vllm

__all__ = ["NcclWeightTransport"]


class NcclWeightTransport:
    """The trainer's end of vLLM's NCCL weight-transfer engine (vLLM >= 0.28): one CUDA process joining the server's
    workers as rank 0 of a stateless group, then broadcasting packed tensors to them."""

    def __init__(self) -> None:
        self.group: Any = None

    def address(self) -> str:
        """This machine's address as the server's workers reach it (vLLM's choice, ``VLLM_HOST_IP`` first)."""
        require_vllm()
        from vllm.utils.network_utils import get_ip

        return get_ip()

    def open(self, init_info: dict[str, Any]) -> None:
        """Join the group the server creates from the same ``init_info`` (blocks until every worker joined)."""
        if not torch.cuda.is_available():
            raise RuntimeError(
                "Sending weights to a vLLM server runs on vLLM's NCCL weight-transfer engine, which needs a CUDA "
                "device in the training process; this machine has none."
            )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(init_info)

    def send(self, tensors: Iterator[tuple[str, Tensor]]) -> None:
        """Broadcast ``tensors`` (in the announced order) as packed buffers."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        packed_nccl_broadcast_producer(iterator=tensors, group=self.group, src=0, post_iter_func=lambda item: item[1])
