"""Typed decisions and chat from one GGUF model, served the SageMaker way."""

__version__ = "0.1.0"
