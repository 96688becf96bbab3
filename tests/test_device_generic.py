"""Outside the backend plugins nothing names a device type: the core, the layers, the models and the quant
methods get their device from the backend (``DeviceBackend.device``) and their kernels from its ``op()``
table, so a new device is a new backend plugin and nothing else.

Every remaining exception is listed below with the reason it is still there; an entry that no longer
matches anything fails too, so the list only shrinks.
"""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pluginfer"
SCANNED = ("core", "engine", "text", "formats", "layers", "models", "quant")
# A device type in quotes, a device test, or a device module of torch.
DEVICE_NAME = re.compile(r"""["'](cuda|mps|cpu|gcu|xpu|npu|hpu)(:\d+)?["']|\bis_cuda\b|\btorch\.(cuda|mps|xpu)\b"""
                         r"""|\bbackends\.mps\b""")

# (file under pluginfer/, text on the line): why it stays.
ALLOWED = {
    ("layers/moe.py", 'pin = device.type == "cuda"'):
        "page-locked host memory for asynchronous expert copies is a CUDA allocator feature; torch has no "
        "device-generic way to ask whether pinning helps a device",
    ("layers/moe.py", 'dtype=ctx.dtype, device="cpu", pin_memory=pin)'):
        "the offloaded experts' store is host memory by design, whatever the compute device",
    ("quant/ggml_blocks.py", 'raw.device.type == "cpu"'):
        "the cpu backend's native GGML dequantizer reads host memory: blocks elsewhere take the torch path "
        "(on the cuda backend the table's block kernels run before it is reached)",
    ("formats/safetensors.py", 'torch.load(file, map_location="cpu"'):
        "a pickle checkpoint is read into host memory (memory-mapped), like safetensors, before the layers' "
        "loaders copy it to the backend's device",
    ("engine/sampler.py", 'if logits.device.type == "cpu" and logits.dtype == torch.float32'):
        "the greedy shortcut hands host float32 logits to numpy's argmax; numpy reads host memory only, any "
        "other device keeps torch.argmax",
    ("formats/gguf/checkpoint.py", 'if source.device.type != "cpu" or source.numel() == 0:'):
        "only a tensor in host memory can lie in a GGUF file's memory mapping, whose pages release_file_pages "
        "gives back; a tensor on any other device has nothing to release",
    ("formats/gguf/checkpoint.py", 'if source.device.type != "cpu" or target.device.type != "cpu"'):
        "read_file_bytes preads file bytes into host memory; a target on another device is copied by torch",
    ("engine/input_batch.py", 'if torch.device(device).type == "cpu":'):
        "numpy's arrays are host memory: a step for a host-memory device wraps them without a copy or a .to() "
        "per array (a decode step's fixed cost); any other device gets the copy",
    ("quant/gguf.py", 'loaded.device.type == "cpu" and torch.device(device).type == "cpu"'):
        "an F16/BF16 tensor is read in place only as a view of the GGUF file's mapping, which is host memory, "
        "and only when the model's device reads host memory too; elsewhere it is copied as before",
    ("engine/sampler.py", 'if not (columns.device.type == "cpu" and columns.dtype == torch.float32'):
        "the greedy rows' numpy view, kept while a decode replay hands the same logits tensor again: numpy "
        "reads host memory only, any other device keeps greedy_argmax's torch path",
    ("engine/worker.py", 'self._last_batch = batch if batch.input_ids.device.type == "cpu" else None'):
        "a repeated decode step hands the last ForwardBatch again only when its tensors are the input batch's "
        "numpy arrays wrapped without a copy, which happens for host memory alone; on any other device each "
        "step's arrays are copied to fresh tensors and the batch is built again",
    ("engine/sampler.py", 'sync_free = logits.device.type != "cpu"'):
        "top-k/top-p's candidate shortcut reads its width back from the logits, free on host memory and a "
        "device sync anywhere else, where one full sort replaces it",
}


def _occurrences() -> list[tuple[str, str]]:
    found = []
    for folder in SCANNED:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            for line in path.read_text().splitlines():
                if DEVICE_NAME.search(line):  # comments and docstrings too: a quoted device name is a name
                    found.append((path.relative_to(PACKAGE).as_posix(), line.strip()))
    return found


def test_nothing_outside_the_backends_names_a_device() -> None:
    unexplained = [f"pluginfer/{path}: {line}" for path, line in _occurrences()
                   if not any(path == allowed_path and text in line for allowed_path, text in ALLOWED)]
    assert not unexplained, ("device types named outside the backend plugins (take the device from the backend "
                             "and kernels from DeviceBackend.op, or add a reasoned entry to ALLOWED):\n"
                             + "\n".join(unexplained))


def test_every_allowed_exception_still_exists() -> None:
    occurrences = _occurrences()
    stale = [entry for entry in ALLOWED
             if not any(path == entry[0] and entry[1] in line for path, line in occurrences)]
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


# A device library's private ops (oneDNN's packed layouts) or a backend's own modules.
DEVICE_LIBRARY = re.compile(r"\bmkldnn\b|\bonednn\b|\bpluginfer\.backends\b|\bfrom pluginfer import backends\b")


def test_only_the_backends_reach_device_libraries() -> None:
    """oneDNN's packed weights (``torch.ops.mkldnn``) and the backends' modules are the cpu backend's business
    (``backends/cpu_dense.py`` through the kernel table): the rest of the package never names them, comments
    and docstrings included."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.split("/")[0] in ("backends", "builtin_plugins.py"):
            continue
        found += [f"pluginfer/{relative}: {line.strip()}" for line in path.read_text().splitlines()
                  if DEVICE_LIBRARY.search(line)]
    assert not found, "device libraries named outside pluginfer/backends:\n" + "\n".join(found)


def test_the_device_library_pattern_catches_what_it_should() -> None:
    for text in ("torch.ops.mkldnn._linear_pointwise(x, w)", "from pluginfer.layers import onednn",
                 "torch.backends.mkldnn.is_available()", "from pluginfer.backends import native"):
        assert DEVICE_LIBRARY.search(text), text
    for text in ("ctx.backend.op('dense_linear')", "backend_op(backend, 'dense_pack')", "self.backends"):
        assert not DEVICE_LIBRARY.search(text), text


def test_the_pattern_catches_what_it_should() -> None:
    for text in ('x.to("cuda")', "torch.device('cpu')", "if x.is_cuda:", "torch.cuda.synchronize()",
                 'device="mps"', "torch.backends.mps.is_available()", 'torch.device("cuda:1")'):
        assert DEVICE_NAME.search(text), text
    for text in ("device=self.backend.device", "x.device", "ctx.backend.op('rms_norm')", "'cpu_threads'"):
        assert not DEVICE_NAME.search(text), text
