"""One byte-store interface for datasets: local directories and object stores (docs/design.md §2, §9).

Everything that reads or writes a dataset goes through a :class:`Store`; :func:`open_store` turns a
local path or a URL (``s3://``, ``gs://``, ``az://``, ``http(s)://``) into one. See
:mod:`shardkit.stores.base` for the interface, :mod:`shardkit.stores.url` for the URLs and the
environment variables, :mod:`shardkit.stores.objectstore` for concurrency, retries and copies, and
:mod:`shardkit.stores.cache` for the local cache of remote shards.

Importing this package does not import obstore (the ``remote`` extra): that happens when the first
object-store URL is opened.
"""

from shardkit.stores.base import DEFAULT_OPTIONS, ByteRange, Fetched, ObjectMeta, Store, StoreOptions, check_key, join_key
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
    "join_key",
]
