"""Registers the built-in collectives."""

from pluginfer.core.hookspecs import CollectiveSpec, hookimpl


@hookimpl
def pluginfer_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(name="single", aliases=("none",), launchers=("inprocess",),
                       factory="pluginfer.collectives.single:build",
                       description="one rank, no communication"),
        CollectiveSpec(name="gloo", factory="pluginfer.collectives.torch_distributed:build_gloo",
                       check="pluginfer.collectives.torch_distributed:gloo_unavailable",
                       description="torch.distributed gloo: CPU tensors, TCP between processes and machines"),
        CollectiveSpec(name="nccl", factory="pluginfer.collectives.torch_distributed:build_nccl",
                       check="pluginfer.collectives.torch_distributed:nccl_unavailable",
                       description="torch.distributed NCCL: CUDA tensors, one GPU per rank (cuda:local_rank)"),
        CollectiveSpec(name="mpi", factory="pluginfer.collectives.mpi:build", launchers=("mpi",),
                       check="pluginfer.collectives.mpi:unavailable",
                       description="MPI through mpi4py: ranks started by mpiexec, CPU tensors via numpy"),
    ]
