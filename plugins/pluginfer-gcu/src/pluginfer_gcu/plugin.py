"""Registration only: cheap to import, never touches torch_gcu (the checks and factories do, when asked)."""

from pluginfer.core.hookspecs import BackendSpec, CollectiveSpec, hookimpl


@hookimpl
def pluginfer_backends() -> list[BackendSpec]:
    return [
        BackendSpec(name="gcu", factory="pluginfer_gcu.backend:build",
                    check="pluginfer_gcu.device:why_not_usable", priority=15, api_versions=(5, 6),
                    description="Enflame GCUs through torch_gcu (gcu:local_rank), torch attention"),
    ]


@hookimpl
def pluginfer_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(name="eccl", factory="pluginfer_gcu.collective:build",
                       check="pluginfer_gcu.collective:why_not_usable", api_versions=(5, 6),
                       description="Enflame ECCL through torch.distributed (the process group torch_gcu registers)"),
    ]
