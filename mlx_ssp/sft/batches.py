"""Batch iteration: mlx-lm's ``iterate_batches`` made reproducible and resumable."""

from __future__ import annotations


def make_iterate_batches(seed: int, skip: int = 0):
    """mlx-lm's ``iterate_batches`` with its NumPy shuffling confined to a private, seeded
    ``RandomState`` (training and validation get separate streams), and the first ``skip``
    training batches dropped (resume: they were already trained on). The training stream starts
    from ``seed`` exactly as ``mlx_lm lora`` seeds NumPy, so the batch order is the same as its."""
    import numpy as np
    from mlx_lm.tuner.trainer import iterate_batches

    def wrapped(dataset, batch_size, max_seq_length, loop=False, seed=None, comm_group=None):
        own = np.random.RandomState(seed_for(loop)).get_state()
        inner = iterate_batches(dataset, batch_size, max_seq_length, loop=loop, comm_group=comm_group)
        n = 0
        while True:
            outer = np.random.get_state()
            np.random.set_state(own)
            try:
                batch = next(inner)
            except StopIteration:
                return
            finally:
                own = np.random.get_state()
                np.random.set_state(outer)
            n += 1
            if loop and n <= skip:
                continue
            yield batch

    def seed_for(loop: bool) -> int:
        # training: the seed itself, so the batch order equals `mlx_lm lora --seed SEED`'s
        return (seed + (0 if loop else 1)) % (1 << 32)

    return wrapped


