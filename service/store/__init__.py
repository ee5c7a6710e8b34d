"""Where weights live: the model store, the embedded model, hub downloads."""
