"""The jobs and their blocks, below the methods: what is merged (``match.py``: base and agents matched from their
headers), how a job is read (``blocks.py``: float32 blocks for torch; ``fast.py``: the numba block stream over the
mapped inputs). The engine and the families' own backends (methods/sparsify/) read through it."""
