"""A run from config to exit: the setup path, batches, metrics, the training loop, generation."""
