"""Extras: features a fork may keep or delete, each a folder of its own with its configs and tests. The core
(everything outside this folder) never imports them; an extra imports the core, and, where another extra is
optional to it, only if that one is there (`try: ... except ModuleNotFoundError`). README, "What to delete"."""
