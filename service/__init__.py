"""nim-torch: a NIM-style packaged LLM inference microservice."""

__version__ = "0.1.0"
