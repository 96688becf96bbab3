"""LoRA adapters on the server, as vLLM serves them: a request names one in ``model``; ``/v1/models`` lists them
with their base (``parent``); ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them at run time
when ``lora.allow_runtime_lora_updating`` is set."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

from pluginfer.core.config import EngineConfig
from pluginfer.engine.lora_request import LoRARequest, lora_modules
from pluginfer.server.errors import APIError, bad_request
from pluginfer.server.state import STATE, ServerState, read_body


class ServedAdapters:
    """The adapters a server serves, by name (those of ``lora.lora_modules`` from the start)."""

    def __init__(self, config: EngineConfig) -> None:
        self.enabled = config.lora.enable_lora
        self.by_name = {request.lora_name: request for request in lora_modules(config.lora.lora_modules)}
        self._ids = itertools.count(len(self.by_name) + 1)

    def next_id(self) -> int:
        return next(self._ids)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "pluginfer",
             "root": name, "parent": state.model_name,  # (no local path on the API)
             "max_model_len": state.model_info.max_model_len}
            for name, request in state.adapters.by_name.items()]


def _check_updating(state: ServerState) -> None:
    if not state.config.lora.allow_runtime_lora_updating:
        raise APIError(404, "runtime LoRA updating is off: start the server with --allow-runtime-lora-updating "
                       "(lora.allow_runtime_lora_updating)", code="not_found")
    if not state.adapters.enabled:
        raise APIError(400, "LoRA is not enabled: start the server with --enable-lora (lora.enable_lora)")


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_updating(state)
    body = await read_body(request, LoadLoRAAdapterRequest)
    name = body.lora_name.strip()
    if not name or not body.lora_path.strip():
        raise bad_request("lora_name and lora_path must not be empty", "lora_name" if not name else "lora_path")
    if name in state.adapters.by_name or name == state.model_name or name in state.aliases:
        raise bad_request(f"the LoRA adapter {name!r} has already been loaded (or names the base model)",
                          "lora_name")
    adapter = LoRARequest(name, state.adapters.next_id(), body.lora_path)
    try:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.check_lora, adapter)
    except ValueError as exc:
        raise bad_request(str(exc), "lora_path") from None
    state.adapters.by_name[name] = adapter
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _check_updating(state)
    body = await read_body(request, UnloadLoRAAdapterRequest)
    if state.adapters.by_name.pop(body.lora_name, None) is None:  # requests already running keep theirs
        raise APIError(404, f"the LoRA adapter {body.lora_name!r} cannot be found", "lora_name", "model_not_found")
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
