"""Atomic local writes live in :mod:`shardkit.stores.atomic` (the store layer); re-exported here."""

from shardkit.stores.atomic import fsync_dir, is_out_of_space, raise_out_of_space, write_bytes_atomic

__all__ = ["fsync_dir", "write_bytes_atomic", "raise_out_of_space", "is_out_of_space"]
