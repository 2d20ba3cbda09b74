"""Looking at a dataset's records: contact sheets, audio plots, and records written back as files.

``show`` draws chosen records into one PNG (images with Pillow alone; audio plots with matplotlib,
the ``viz`` extra, imported only when an audio dataset is shown); ``export`` writes them as PNG / WAV.
"""

from shardkit.viz.records import ShowResult, export, show
from shardkit.viz.selection import MAX_RECORDS, Selection, parse_keys, select_keys

__all__ = ["MAX_RECORDS", "Selection", "ShowResult", "export", "parse_keys", "select_keys", "show"]
