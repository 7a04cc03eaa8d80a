"""The tool-use testbed: four toy backends under the environment contract (:mod:`.envs`), a seeded
episode generator with graded levels, chained arguments, irrelevance turns and a held-out part of the
space (:mod:`.episodes`), and the ``testbed_tools:BACKEND`` task source (:mod:`.source`)."""
