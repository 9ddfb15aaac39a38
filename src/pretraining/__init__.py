"""A Lightning + Hydra template for pretraining transformers on WebDataset shards."""

from importlib.metadata import version

__version__ = version("pretraining")  # pyproject.toml's; CHANGELOG.md says what each one changed
