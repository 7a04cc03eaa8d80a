"""The testbed: a model family pretrained from scratch in minutes on this CPU, on a
synthetic task family designed for the recipe's questions (graded difficulty, several correct
strategies per problem in unequal proportions, domains that interfere). :mod:`.problems` holds the
tasks and traces, :mod:`.source` the ``testbed:DOMAIN`` task source and the ``testbed`` verifier,
:mod:`.build` the pretraining and the cache (model spec ``testbed``)."""
