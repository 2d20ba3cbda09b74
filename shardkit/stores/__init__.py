"""One byte-store interface for datasets: local directories and object stores (docs/design.md §2, §9).

:func:`open_store` turns a local path or a URL into a :class:`Store`. obstore (the ``remote`` extra)
is imported only when the first object-store URL is opened.
"""

from shardkit.stores.base import DEFAULT_OPTIONS, ByteRange, Fetched, ObjectMeta, Store, StoreOptions, check_key
from shardkit.stores.local import LocalStore
from shardkit.stores.objectstore import ObjectStore
from shardkit.stores.url import Location, as_location, is_url, location_string, open_store

__all__ = [
    "Store",
    "StoreOptions",
    "DEFAULT_OPTIONS",
    "ObjectMeta",
    "ByteRange",
    "Fetched",
    "LocalStore",
    "ObjectStore",
    "Location",
    "open_store",
    "as_location",
    "is_url",
    "location_string",
    "check_key",
]
