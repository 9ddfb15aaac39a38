"""Backbones in plain PyTorch (no Lightning inside): `transformer.Transformer` (GPT-2) and `llama.Llama`, each
loaded only by a run that builds it."""
