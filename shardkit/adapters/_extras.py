"""The lazy import of optional dependencies lives in :mod:`shardkit._extras` (used below the
adapters too, e.g. by the object stores); re-exported here for the adapters."""

from shardkit._extras import import_extra

__all__ = ["import_extra"]
