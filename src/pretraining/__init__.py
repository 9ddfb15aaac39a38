"""A Lightning + Hydra template for pretraining transformers on WebDataset shards."""
