"""The trainer: the modules every stage shares. The stages themselves are in `fastrlhf.train.recipes`."""
