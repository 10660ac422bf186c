"""Tensor parallelism: one process per rank; rank 0 (the engine's own process) schedules and samples, every
rank runs the same forward on its shard of the weights.

- plan: how a model is split (heads, KV heads split or replicated, intermediate), pure Python.
- comm: the two process groups of a rank (control: gloo, for step inputs; compute: nccl on CUDA, gloo on CPU)
  with timeouts on every collective.
- step_io: rank 0 ships each step's packed input; the other ranks receive it.
- launcher: rank 0 spawns the other ranks, checks they agree on model and config, watches them.
The loop of ranks > 0 is engine/ranks.py (it needs the model runner, which needs this package).
"""
