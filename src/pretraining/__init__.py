"""A Lightning + Hydra template for pretraining transformers on WebDataset shards."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pretraining")  # pyproject.toml's; CHANGELOG.md says what each one changed
except PackageNotFoundError:  # run from a source tree that is not installed, or installed under another name
    __version__ = "0+unknown"
