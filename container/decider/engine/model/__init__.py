"""The model: llama.cpp through ctypes (native), the GGUF file, its backends and load probe, its
tokenizer's markers and verified labels, and the prompts built with its chat template."""
