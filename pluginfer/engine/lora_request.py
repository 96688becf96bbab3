"""The LoRA adapter a request names, and ``--lora-modules``' list of them: no torch, so that the server's
process, which imports this, stays without it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def key(self) -> bytes:
        """What tells this adapter's cached prefixes apart from the base model's and other adapters'."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}".encode()



def lora_modules(modules: list[str]) -> list[LoRARequest]:
    """``lora.lora_modules`` (``name=path`` each) as requests, ids from 1 in order; a ValueError naming the field."""
    requests, names = [], set()
    for index, entry in enumerate(modules, start=1):
        name, sep, path = entry.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise ValueError(f"lora.lora_modules (--lora-modules): {entry!r} is not name=path")
        if name in names:
            raise ValueError(f"lora.lora_modules (--lora-modules): adapter name {name!r} is given twice")
        names.add(name)
        requests.append(LoRARequest(name, index, path))
    return requests
