"""Multi-turn tool-use episodes on BFCL's executable backends.

- :mod:`.calls`: a model's message -> :class:`~.calls.Call` data (never evaluated).
- :mod:`.backends`: one episode's fresh backend instances and the execution of calls against them.
- :mod:`.worker`: the process those instances live in, killed when a call is over its time limit.
- :mod:`.checker`: BFCL's multi-turn checker semantics (state and response per turn) by re-execution.
- :mod:`.episode`: one episode's conversation, tokens, model-token mask and behaviour log-probs.
- :mod:`.engine`: many episodes through one mlx-lm ``BatchGenerator`` with per-episode KV caches.
"""
