"""The ``mlx_ssp`` subcommands, one module per subcommand, each exposing a click command ``cli``.

A command module holds CLI plumbing only: its flags, the flags turned into a config through the one
loader (:func:`mlx_ssp.stage_config.load_stage`), one call of the stage's library function, and what
it prints. :mod:`.options` holds the flags several commands share; :mod:`mlx_ssp.cli` is the group
that imports these modules lazily (``mlx_ssp --help`` imports none of them).
"""
