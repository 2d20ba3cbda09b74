"""A process that exits while object-store requests are in flight exits cleanly.

obstore finishes a request on its own runtime thread, which then takes the GIL to hand the result
to the event loop; if the interpreter is finalizing by then, the process aborts (SIGABRT or SIGBUS,
empty stderr: seen about once in 12 runs of ``shardkit verify s3://...``). The store waits at exit
until the requests it sent have settled and obstore's threads have left the Python code that hands
their results over (shardkit/stores/objectstore.py, ``_Runner``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

from shardkit.stores import open_store

# The races, made certain: obstore's thread hands the result over 1.5 s after the request (a hook on
# the loop's call_soon_threadsafe, called only by that thread here) and stays in Python 1 s after
# (call_soon_threadsafe's write to the self-pipe releases the GIL and takes it again: the loop can run
# the callback in between), the script's main thread ends at 0.5 s, and an exit hook leaves garbage
# whose finalizer keeps the interpreter finalizing for 2 s.
_SCRIPT = """
import atexit, gc, sys, threading, time
from shardkit.stores import objectstore, open_store
from shardkit.stores.base import ByteRange

store = open_store(sys.argv[1])
loop = objectstore._get_runner().loop
handover = loop.call_soon_threadsafe

def late_handover(*args, **kwargs):
    theirs = threading.current_thread().name.startswith("Dummy")  # a thread Python did not start: obstore's
    if theirs:
        time.sleep(1.5)
    handle = handover(*args, **kwargs)
    if theirs:  # still in Python once the loop may have run the callback, as in the self-pipe's send
        time.sleep(1.0)
    return handle

loop.call_soon_threadsafe = late_handover
pending = store.start_fetch([ByteRange("blob", 0, 16)])
time.sleep(0.5)

class SlowFinalizer:
    def __del__(self, sleep=time.sleep):
        sleep(2.0)

def leave_garbage():
    cycle = SlowFinalizer()
    cycle.me = cycle

gc.set_threshold(1 << 30)  # collected only by the interpreter's own collection at finalization
atexit.register(leave_garbage)
"""


def test_exit_with_a_ranged_read_in_flight_is_clean(s3: Any) -> None:
    url = s3.url("exit")
    open_store(url).put("blob", bytes(1024))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, url], capture_output=True, text=True, timeout=120,
                          check=False, env=dict(os.environ))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
