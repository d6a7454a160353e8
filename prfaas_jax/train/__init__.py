"""Training the hybrid model: synthetic recall tasks (``tasks``), the optax loop (``loop``) and
resumable orbax checkpoints of a run (``checkpoints``)."""
