"""The GCU device through ``torch_gcu``: whether it is here, and this rank's device."""

from __future__ import annotations

import importlib
import importlib.util

import torch

DEVICE_TYPE = "gcu"
HOW_TO_GET = "Enflame's PyTorch extension, installed with the TopsRider software stack and the GCU driver"


def load_torch_gcu() -> object:
    """Import ``torch_gcu``: it registers the ``gcu`` device and the ``eccl`` process group with torch."""
    return importlib.import_module("torch_gcu")


def why_not_usable() -> str | None:
    """None when torch_gcu loads and sees a GCU, else why not (the backend's check)."""
    if importlib.util.find_spec("torch_gcu") is None:
        return f"torch_gcu is not installed ({HOW_TO_GET})"
    try:
        load_torch_gcu()
    except Exception as exc:
        # a broken driver install: report it, never crash the listing
        return f"torch_gcu fails to import: {type(exc).__name__}: {exc}"
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if accelerator is None or accelerator.type != DEVICE_TYPE or torch.accelerator.device_count() == 0:
        return "no GCU device"
    return None


def rank_device(local_rank: int) -> torch.device:
    """``gcu:{local_rank}``, made this process's current device (collectives and allocations use it)."""
    device = torch.device(DEVICE_TYPE, local_rank)
    torch.accelerator.set_device_index(local_rank)
    return device
