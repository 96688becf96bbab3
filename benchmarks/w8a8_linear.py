"""One linear layer of a 0.5B shape on the cpu backend: W8A8 (``compressed-tensors``) against W8A16 (``int8``) and
dense bf16 / float32 weights, at several row counts, in one run.

    python benchmarks/w8a8_linear.py [--inputs 896] [--outputs 4864] [--rows 1 16 512] [--runs 7]

Each layer is built as a model's would be (the quant method through the backend's kernel table) from the same
random weight; timings are medians of ``--runs`` rounds, the layers interleaved within each round.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from pluginfer.backends.cpu import backend as cpu
from pluginfer.collectives import single
from pluginfer.core.protocols import BuildContext
from pluginfer.core.registry import get_registry
from pluginfer.layers.context import building
from pluginfer.layers.linear import ReplicatedLinear

W8A8_CONFIG = {  # what llm-compressor's W8A8 scheme writes (the fields the method reads)
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
}


def build(quant: str, config: dict | None, weight: torch.Tensor, dtype: torch.dtype) -> ReplicatedLinear:
    method = get_registry().load("quant", quant)(config)
    ctx = BuildContext(backend=cpu.build(), quant=method, collective=single.build(), dtype=dtype, max_model_len=64)
    with building(ctx):
        layer = ReplicatedLinear(weight.shape[1], weight.shape[0])
    if quant == "compressed-tensors":
        scale = weight.abs().amax(dim=1, keepdim=True) / 127.5
        layer.weight.weight_loader(layer.weight, torch.round(weight / scale).clamp(-128, 127).to(torch.int8))
        layer.weight_scale.weight_loader(layer.weight_scale, scale)
    else:
        layer.weight.weight_loader(layer.weight, weight.to(dtype))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def seconds(layer: ReplicatedLinear, x: torch.Tensor) -> float:
    repeats = max(3, int(2e8 // (x.shape[0] * x.shape[1] * layer.output_size) + 1))
    with torch.inference_mode():
        layer(x)
        start = time.perf_counter()
        for _ in range(repeats):
            layer(x)
        return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=896)
    parser.add_argument("--outputs", type=int, default=4864)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    weight = torch.randn(args.outputs, args.inputs) * 0.05
    layers = {  # name -> (layer, activation dtype)
        "W8A8 (compressed-tensors)": (build("compressed-tensors", W8A8_CONFIG, weight, torch.float32), torch.float32),
        "W8A16 int8, float32 x": (build("int8", None, weight, torch.float32), torch.float32),
        "W8A16 int8, bf16 x": (build("int8", None, weight, torch.bfloat16), torch.bfloat16),
        "bf16 weights": (build("none", None, weight, torch.bfloat16), torch.bfloat16),
        "float32 weights": (build("none", None, weight, torch.float32), torch.float32),
    }
    from pluginfer.backends.cpu import int8_gemm

    cpu_name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                    platform.processor())
    print(f"{args.outputs}x{args.inputs} linear, {torch.get_num_threads()} threads, {cpu_name}; "
          f"W8A8 kernel: {int8_gemm.isa()}; medians of {args.runs}")
    print("| layer | " + " | ".join(f"{rows} rows: ms (W8A8 speed-up)" for rows in args.rows) + " |")
    print("| --- |" + " --- |" * len(args.rows))
    results: dict[str, dict[int, float]] = {name: {} for name in layers}
    for rows in args.rows:
        x = torch.randn(rows, args.inputs)
        times: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(args.runs):
            for name, (layer, dtype) in layers.items():
                times[name].append(seconds(layer, x.to(dtype)))
        for name in layers:
            results[name][rows] = statistics.median(times[name])
    w8a8 = results["W8A8 (compressed-tensors)"]
    for name in layers:
        cells = [f"{results[name][rows] * 1e3:.3f} ({results[name][rows] / w8a8[rows]:.2f}x)" for rows in args.rows]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
