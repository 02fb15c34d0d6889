"""Dense peak FLOP/s of current data-centre GPUs, by the name CUDA gives the device, for MFU.

Why our own table: Lightning's (``lightning.fabric.utilities.throughput.get_available_flops``) does not know the
name an H200 SXM reports (``"NVIDIA H200"``: it matches only ``"h200 sxm1"`` / ``"h200 nvl1"``, so MFU went
unlogged on the first GPU run), and its H200 and H100 NVL figures are the datasheets' "with sparsity" ones, twice
the dense peak that dense training can reach. MFU here is measured against the dense peak (the PaLM convention
``6 x parameters x tokens/s`` against 989 TFLOP/s on an H100 SXM / H200), so the figures below are the NVIDIA
datasheets' dense tensor-core peaks (the sparse figure halved where only that is printed), per GPU. A device not
listed here falls back to Lightning's table (A100, A10G, L4, consumer cards...).

``"tfloat32"`` is fp32 matrix work on tensor cores (``torch.backends.cuda.matmul.allow_tf32``), as in Lightning's
table.

Example:
    >>> dense_peak_flops("NVIDIA H200", torch.bfloat16)
    989000000000000.0
    >>> dense_peak_flops("Tesla T4", torch.bfloat16) is None  # not in this table
    True
"""

from __future__ import annotations

import torch

__all__ = ["DENSE_PEAK_FLOPS", "dense_peak_flops", "gpu_model"]

_H100_SXM = {torch.float64: 33.5e12, torch.float32: 66.9e12, "tfloat32": 494.7e12,
             torch.bfloat16: 989.0e12, torch.float16: 989.0e12}  # fmt: skip
_H100_NVL = {torch.float64: 30.0e12, torch.float32: 60.0e12, "tfloat32": 417.5e12,
             torch.bfloat16: 835.5e12, torch.float16: 835.5e12}  # fmt: skip

# Per GPU model: dense peak FLOP/s by dtype (sources: NVIDIA H100, H200, GH200, L40S and A100 datasheets).
DENSE_PEAK_FLOPS: dict[str, dict[torch.dtype | str, float]] = {
    "h100 sxm": _H100_SXM,
    "h100 pcie": {torch.float64: 25.6e12, torch.float32: 51.2e12, "tfloat32": 378.0e12,
                  torch.bfloat16: 756.0e12, torch.float16: 756.0e12},  # fmt: skip
    "h100 nvl": _H100_NVL,
    "h200 sxm": _H100_SXM,  # the same GH100 compute as the H100 SXM, with more and faster memory
    "h200 nvl": _H100_NVL,
    "gh200": _H100_SXM,
    "l40s": {torch.float32: 91.6e12, "tfloat32": 183.0e12, torch.bfloat16: 362.05e12, torch.float16: 362.05e12},
    "a100": {torch.float64: 9.7e12, torch.float32: 19.5e12, "tfloat32": 156.0e12,
             torch.bfloat16: 312.0e12, torch.float16: 312.0e12},  # fmt: skip
}


def gpu_model(device_name: str) -> str | None:
    """The key of :data:`DENSE_PEAK_FLOPS` for a CUDA device name (``torch.cuda.get_device_name``), or ``None``.

    Names as CUDA reports them: ``NVIDIA H200`` and ``NVIDIA H200 NVL``, ``NVIDIA H100 80GB HBM3`` (SXM),
    ``NVIDIA H100 PCIe``, ``NVIDIA H100 NVL``, ``NVIDIA GH200 480GB``, ``NVIDIA L40S``, ``NVIDIA A100-SXM4-80GB``.
    """
    name = device_name.lower()
    if "gh200" in name:  # before "h200", which it contains
        return "gh200"
    if "h200" in name:
        return "h200 nvl" if "nvl" in name else "h200 sxm"
    if "h100" in name:
        if "nvl" in name:
            return "h100 nvl"
        return "h100 pcie" if "pcie" in name or "hbm2e" in name else "h100 sxm"
    if "l40s" in name:
        return "l40s"
    if "a100" in name:
        return "a100"
    return None


def dense_peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Dense peak FLOP/s of the GPU named ``device_name`` in ``dtype``; ``None`` when this table lacks either."""
    model = gpu_model(device_name)
    return DENSE_PEAK_FLOPS[model].get(dtype) if model is not None else None
