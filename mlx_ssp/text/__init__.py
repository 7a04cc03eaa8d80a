"""Bounded scans of model text that verifiers and the agents share: the work counter every scan
charges (:mod:`.work`), the region of a completion searched for its answer (:mod:`.region`), and
tool calls written as ``<tool_call>`` blocks or JSON call objects (:mod:`.toolcalls`). Nothing here
imports the verifiers or the agents."""
