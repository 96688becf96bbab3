"""Run pluginfer's engine on one backend and print what it generated, as JSON (a script, not a test).

``python tests/backends/cuda_interpreted.py SPEC.json``: SPEC holds ``model``, ``backend``, ``engine``
(LLM keyword arguments), ``prompt_groups`` (lists of token-id prompts, or ``{"prompt_token_ids": ...,
"images": [image file paths]}`` for a model that takes images, generated one group after the
other in one engine, so later groups hit the prefix cache), ``max_tokens`` and, optionally, ``adapters`` (per
group, each prompt's LoRA adapter directory or null, with ``enable_lora`` in ``engine``). For the cuda backend on a
machine without a GPU the caller sets ``TRITON_INTERPRET=1`` and ``PLUGINFER_CUDA_ON_CPU=1`` before this
process starts (Triton reads the first once, at import); on a GPU it sets neither, and the kernels are
compiled for it. Every kernel registered into a ``KernelTable`` is counted, so the caller can tell which
Triton kernels ran, and the decode graphs' replays are reported.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from collections.abc import Callable

CALLS: Counter = Counter()


def environment(interpret: bool) -> dict[str, str]:
    """The environment a test runs this script (or another Triton case runner) in: the checkout importable
    ahead of any PYTHONPATH already set, and Triton's interpreter on CPU tensors, or neither variable (the
    kernels compiled for a GPU)."""
    import os
    from pathlib import Path

    path = os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    for name in ("TRITON_INTERPRET", "PLUGINFER_CUDA_ON_CPU"):
        env.pop(name, None)
        if interpret:
            env[name] = "1"
    return env


def _count_registered_kernels() -> None:
    from pluginfer.core.kernels import KernelTable

    register = KernelTable.register

    def counting(self: KernelTable, name: str, implementation: Callable) -> None:
        @functools.wraps(implementation)  # keeps the signature the table checks
        def counted(*args: object) -> object:
            CALLS[name] += 1
            return implementation(*args)

        register(self, name, counted)

    KernelTable.register = counting


def _poison_allocations() -> None:
    """Every tensor ``torch.empty``/``empty_like``/``new_empty`` hands out starts as NaN (floats) or -7777
    (integers): a kernel that leaves part of its output unwritten then shows, as it would on a GPU, whose
    caching allocator hands back used memory, where fresh CPU pages often read as zeros."""
    import torch

    def poisoned(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.fill_(float("nan") if tensor.is_floating_point() else -7777)

    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty
    torch.empty = lambda *args, **kwargs: poisoned(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poisoned(empty_like(*args, **kwargs))
    torch.Tensor.new_empty = lambda self, *args, **kwargs: poisoned(new_empty(self, *args, **kwargs))


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    _count_registered_kernels()
    if spec.get("poison_allocations"):
        _poison_allocations()
    from pluginfer import LLM, SamplingParams

    llm = LLM(model=spec["model"], backend=spec["backend"], **spec["engine"])
    backend = llm.engine.executor.backend
    # On a GPU the worker captured real CUDA graphs (unless enforce_eager); on CPU tensors, a stand-in on request.
    graphs = _stand_in_decode_graphs(llm) if spec.get("decode_graphs") else llm.engine.executor.worker.decode_graphs
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
    groups, cached = [], []
    adapters = spec.get("adapters") or [None] * len(spec["prompt_groups"])
    for prompts, paths in zip(spec["prompt_groups"], adapters):
        loras = None if paths is None else [_adapter(path) for path in paths]
        outputs = llm.generate([_with_images(prompt) for prompt in prompts], params, lora_request=loras)
        groups.append([output.outputs[0].token_ids for output in outputs])
        cached.append([output.num_cached_tokens for output in outputs])
    print(json.dumps({"backend": backend.name, "device": str(backend.device), "tokens": groups,
                      "cached_tokens": cached, "kernel_calls": dict(CALLS),
                      "graph_replays": graphs.replays if graphs is not None else None}))


def _adapter(path: str | None) -> object:
    from pathlib import Path

    from pluginfer import LoRARequest

    return None if path is None else LoRARequest(Path(path).name, abs(hash(path)) % 10**6 + 1, path)


def _with_images(prompt: list[int] | dict) -> list[int] | dict:
    """A token-id prompt as is; a dict's image files opened as the engine's ``multi_modal_data``."""
    if not isinstance(prompt, dict):
        return prompt
    from PIL import Image

    images = [Image.open(path).convert("RGB") for path in prompt["images"]]
    return {"prompt_token_ids": prompt["prompt_token_ids"], "multi_modal_data": {"image": images}}


def _stand_in_decode_graphs(llm: object) -> object:
    """The worker's decode steps through ``DecodeGraphs`` (static buffers, buckets, padding rows in the scratch
    KV block) with a stand-in graph that re-runs the forward on replay: on CPU tensors the cuda backend
    captures nothing, so this is how the engine runs the graph path's bookkeeping through the real kernels."""
    import torch

    from pluginfer.backends.cuda_graphs import DecodeGraphs
    from pluginfer.core.device_backend import DecodeForward
    from tests.backends.test_cuda_graphs import CaptureRulesGraph

    worker = llm.engine.executor.worker
    config = worker.config
    forward = DecodeForward(worker.pipeline.forward, worker.pipeline.compute_logits)  # as the worker hands it
    graphs = DecodeGraphs(forward, worker.backend.device, config.scheduler.max_num_seqs,
                          -(-worker.max_model_len // config.cache.block_size), config.cache.block_size,
                          worker.backend.scratch_block, CaptureRulesGraph)
    with torch.inference_mode():
        graphs.capture()
    worker.decode_graphs = graphs
    return graphs


if __name__ == "__main__":
    main(sys.argv[1])
