"""``python -m shardkit`` is the ``shardkit`` command."""

from shardkit.cli.main import main

main()
