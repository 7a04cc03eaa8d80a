"""Multi-turn tool-use episodes on any environment: every multi-turn piece lives here.

- :mod:`.env`: the environment contract (any Python class; tool schemas from signatures).
- :mod:`.environment`: one episode's world (a user class or BFCL's backends) and its calls' execution.
- :mod:`.worker`: the process a world lives in, killed when a call is over its time limit.
- :mod:`.calls`: a model's message -> :class:`~.calls.Call` data (never evaluated).
- :mod:`.render`: native or compact tool rendering.
- :mod:`.source`: the ``episodes:PATH`` task source; :mod:`.bfcl`: BFCL behind the contract.
- :mod:`.score`: the ``episode`` verifier; :mod:`.gold`: ground-truth episodes.
- :mod:`.checker`: BFCL's multi-turn checker semantics (state and response per turn) by re-execution.
- :mod:`.episode`: one episode's conversation, tokens, model-token mask and behaviour log-probs.
- :mod:`.engine`: many episodes through one mlx-lm ``BatchGenerator`` with per-episode KV caches.
"""
