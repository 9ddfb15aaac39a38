"""Lightning plugins the trainer is built with: the FSDP2 strategy with its sharding policy (`fsdp`), and the
atomic, verified checkpoint writer (`checkpoint_io`)."""
