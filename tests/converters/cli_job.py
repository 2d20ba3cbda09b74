"""``python -m tests.converters.cli_job ARGS``: ``shardkit ARGS`` with the test kinds of
:mod:`tests.converters.kinds_for_parts` registered, for tests that need the CLI in a process of its
own (to SIGKILL it). Run as a module with a main guard, so its workers start with ``forkserver`` as
a user's would."""

from __future__ import annotations

import sys

from shardkit.converters.registry import register
from tests.converters.kinds_for_parts import BlockingImages

if __name__ == "__main__":
    register(BlockingImages, replace=True)
    from shardkit.cli.main import main

    main(sys.argv[1:])
