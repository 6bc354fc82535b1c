"""Context parallelism with Lightning's ``ModelParallelStrategy``: the context-parallel group from its device mesh.

``ModelParallelStrategy(data_parallel_size=D, tensor_parallel_size=N)`` builds a (D, N) mesh named
``("data_parallel", "tensor_parallel")`` and gives its distributed sampler the ``data_parallel`` dimension only, so the N
ranks of each ``tensor_parallel`` row receive the same batches: exactly what context parallelism needs. Use that
dimension as the context-parallel group (apply no tensor-parallel plan to the model), and shard the parameters over the
whole mesh so that gradients are averaged over data-parallel and context-parallel ranks alike (FSDP2 on a 2-D mesh:
replicated over ``data_parallel``, sharded over ``tensor_parallel``):

Example:
    >>> class Model(L.LightningModule):
    ...     def configure_model(self):
    ...         fully_shard(self.model, mesh=self.device_mesh)   # every parameter's gradient averaged over D x N ranks
    ...     def training_step(self, batch):
    ...         group = context_parallel_group(self)
    ...         local = shard_batch_for_context_parallel(batch, group=group)
    ...         with cudnn_attention.context_parallel.over(group):
    ...             return self.model(**local).loss
    >>> L.Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=4), devices=8)

Nothing here imports Lightning: the helper reads ``device_mesh`` from what it is given.
"""

from __future__ import annotations

__all__ = ["context_parallel_group"]


def context_parallel_group(source, *, dim: str = "tensor_parallel"):
    """The process group of mesh dimension ``dim`` (default: ``ModelParallelStrategy``'s ``"tensor_parallel"``).

    ``source``: a LightningModule or a strategy (their ``device_mesh``), a Trainer or Fabric (their strategy's), or a
    ``torch.distributed.device_mesh.DeviceMesh``; a mesh of your own may name the dimension ``"cp"``."""
    mesh = source
    for attribute in ("strategy", "device_mesh"):
        if not hasattr(mesh, "mesh_dim_names") and hasattr(mesh, attribute):
            mesh = getattr(mesh, attribute)
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError(
            f"{type(source).__name__} has no device mesh: pass a LightningModule or Trainer running ModelParallelStrategy, or a DeviceMesh"
        )
    if dim not in names:
        raise ValueError(f"the device mesh has dimensions {tuple(names)}, not {dim!r}: pass dim= one of them")
    return mesh.get_group(dim)
