"""mergecomp inside training frameworks, one module per framework (docs/frameworks.md).

* :mod:`.lightning`: ``Trainer(strategy=MergecompDDPStrategy("topk"))`` (DDP with mergecomp's
  hook, any device) or ``Trainer(strategy=MergecompStrategy())`` with ``mc.DistributedOptimizer``
  in ``configure_optimizers`` (no DDP);
* :mod:`.accelerate`: ``register(accelerator, model, "topk")`` on the prepared model;
* :mod:`.transformers`: ``register(trainer, "topk")`` on a ``transformers.Trainer``.

Each module imports its framework when it is imported; ``import mergecomp.torch`` and this
package import none of them.  Shared parts: :mod:`._hook` (registering the hook on a DDP model)
and :mod:`._ranks` (every rank's state in one checkpoint).
"""
__all__ = ["lightning", "accelerate", "transformers"]
