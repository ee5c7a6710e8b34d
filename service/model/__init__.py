"""What a model is, as its files declare it: its config, its architecture, its format, its declared
quantization. No torch and no engine: the store, the selection and the engine all read it."""
