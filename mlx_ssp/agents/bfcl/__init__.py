"""BFCL's multi-turn benchmark behind the environment contract: its executable backends as one
environment (:mod:`.backends`: the registry, building an episode's instances, BFCL's result
format) and its entries as episode tasks (:mod:`.source`: ``bfcl_multi_turn:CATEGORY``)."""
