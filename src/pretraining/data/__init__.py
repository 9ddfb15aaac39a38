"""Corpus readers, shard builder and manifest, tokenizers, example formats, the resumable shard stream
and the DataModule. Import from the modules themselves: this package imports nothing, so that
`pretrain-data` does not load Lightning for the DataModule it never uses."""
