"""`python -m pretraining ...` is `pretrain ...`, for launchers that start a module (torchrun, tests)."""

from pretraining.cli import train

if __name__ == "__main__":
    train()
