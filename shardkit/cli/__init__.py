"""The ``shardkit`` command line: parses arguments and calls library functions, nothing more."""
