"""Registers the built-in device backends."""

from pluginfer.core.hookspecs import BackendSpec, hookimpl


@hookimpl
def pluginfer_backends() -> list[BackendSpec]:
    return [
        BackendSpec(name="cpu", factory="pluginfer.backends.cpu.backend:build",
                    description="torch on the host CPU", details="pluginfer.backends.cpu.ops:report"),
        BackendSpec(name="cuda", factory="pluginfer.backends.cuda:build",
                    check="pluginfer.backends.cuda:why_not_usable", priority=20,
                    description="NVIDIA GPUs (cuda:local_rank): Triton kernels, KV cache in device memory"),
        BackendSpec(name="metal", aliases=("mps",), factory="pluginfer.backends.metal:build",
                    check="pluginfer.backends.metal:why_not_usable", priority=10,
                    description="Apple GPUs through torch's mps device: torch attention over gathered pages"),
    ]
