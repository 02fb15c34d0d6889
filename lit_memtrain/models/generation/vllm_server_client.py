"""The HTTP requests of a ``vllm serve`` server that online RL needs: health, model, weight transfer, completions.

Why our own client rather than TRL's ``VLLMClient``: TRL's needs ``requests`` and vLLM at import and connects
in its constructor; this one uses the standard library, is built without a server, and says how to start the
server when an endpoint is missing (the weight-update endpoints exist only with ``VLLM_SERVER_DEV_MODE=1``).
The requests are the ones TRL 1.16's client sends (see :mod:`~lit_memtrain.models.generation.vllm_server`).
"""

from __future__ import annotations

import json
import time
import warnings
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import Tensor

from lit_memtrain.models.generation.nccl_transport import NcclWeightTransport
from lit_memtrain.models.generation.weight_sync import InferenceWeight

__all__ = ["SERVER_COMMAND", "VLLMServerClient"]

SERVER_COMMAND = (
    """VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}' """
    "--logprobs-mode processed_logprobs"
)
"""How to start a server this client can push weights to, which reports the log-probabilities it samples with
after temperature and the logit processors (TRL's ``vllm-serve`` flag, for the importance-sampling correction)."""


class VLLMServerClient:
    """The requests of a ``vllm serve`` server that training needs (module docstring), over HTTP.

    Args:
        base_url: where the server listens (``http://host:port``).
        transport: how tensors travel to the server (:class:`NcclWeightTransport`).
    """

    def __init__(self, base_url: str, transport: NcclWeightTransport) -> None:
        self.base_url = base_url.rstrip("/")
        self.transport = transport
        self.model: str | None = None

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.base_url}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:2000]
            if error.code == 404:
                raise RuntimeError(
                    f"The vLLM server at {self.base_url} does not serve {method} {path} (404). Start it with the "
                    f"development endpoints and a weight-transfer engine: {SERVER_COMMAND}."
                ) from error
            raise RuntimeError(f"{method} {self.base_url}{path} failed: HTTP {error.code}: {detail}") from error
        return json.loads(text) if text.strip() else None

    def connect(self, timeout_s: float, retry_s: float = 2.0) -> None:
        """Wait for ``/health``, then check that the server can take weights and learn its model's name."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._request("GET", "/health")
                break
            except (urllib.error.URLError, ConnectionError, RuntimeError) as error:
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"No vLLM server answered at {self.base_url} within {timeout_s:.0f} s. Start it first: "
                        f"{SERVER_COMMAND} (see lit_memtrain.models.generation.vllm_server)."
                    ) from error
                time.sleep(retry_s)
        self.model = self._request("GET", "/v1/models")["data"][0]["id"]
        config = self._request("GET", "/server_info?config_format=json")["vllm_config"]
        if config.get("weight_transfer_config") is None:
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has no weight-transfer engine, so it cannot take the trained "
                f"weights. Restart it as {SERVER_COMMAND}."
            )
        logprobs_mode = (config.get("model_config") or {}).get("logprobs_mode", "processed_logprobs")
        if logprobs_mode != "processed_logprobs":  # TRL's warning
            warnings.warn(
                f"The vLLM server at {self.base_url} runs with --logprobs-mode {logprobs_mode}: the log-probabilities "
                "it reports are not those it sampled with, which biases the importance-sampling correction. Restart "
                "it with --logprobs-mode processed_logprobs, or set vllm_importance_sampling_correction=False.",
                stacklevel=2,
            )

    def init_weight_transfer(self, group_port: int) -> None:
        """Set up the NCCL group: the server's workers and this process (its rank 0)."""
        workers = int(self._request("GET", "/get_world_size")["world_size"])
        init_info = {"master_address": self.transport.address(), "master_port": group_port, "rank_offset": 1,
                     "world_size": workers + 1, "packed": True}  # fmt: skip
        with ThreadPoolExecutor(max_workers=1) as pool:  # the server answers once every worker has joined
            answer = pool.submit(self._request, "POST", "/init_weight_transfer_engine", {"init_info": init_info})
            self.transport.open(init_info)
            answer.result()

    def update_weights(self, weights: Sequence[InferenceWeight], tensors: Iterator[tuple[str, Tensor]]) -> None:
        """Replace the served weights: announce ``weights`` (name, dtype, shape), stream ``tensors`` in that order,
        then drop the prefix cache computed with the old ones."""
        update_info = {
            "names": [w.name for w in weights],
            "dtype_names": [str(w.dtype).removeprefix("torch.") for w in weights],
            "shapes": [list(w.shape) for w in weights],
        }
        self._request("POST", "/start_weight_update", {})
        with ThreadPoolExecutor(max_workers=1) as pool:  # the workers receive while answering
            answer = pool.submit(self._request, "POST", "/update_weights", {"update_info": update_info})
            self.transport.send(tensors)
            answer.result()
        self._request("POST", "/finish_weight_update", {})
        self._request("POST", "/reset_prefix_cache")

    def complete(
        self, prompts: list[list[int]], params: dict[str, Any]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The completions' token ids of ``prompts`` (token ids), ``params["n"]`` each, prompt-major, and the
        log-probability the server sampled each token with (NaN where it gave none)."""
        body = {"model": self.model, "prompt": prompts, "return_token_ids": True, "logprobs": 0, **params}
        choices = sorted(self._request("POST", "/v1/completions", body)["choices"], key=lambda c: c["index"])
        logprobs = [
            [float("nan") if value is None else float(value) for value in (choice.get("logprobs") or {}).get(
                "token_logprobs", [None] * len(choice["token_ids"]))]
            for choice in choices
        ]  # fmt: skip
        return [list(choice["token_ids"]) for choice in choices], logprobs
