"""Looking at a dataset's records: contact sheets, audio plots (matplotlib, the ``viz`` extra), and
records written back as PNG / WAV files."""

from shardkit.viz.records import ShowResult, export, show
from shardkit.viz.selection import MAX_RECORDS, Selection, parse_keys, select_keys

__all__ = ["MAX_RECORDS", "Selection", "ShowResult", "export", "parse_keys", "select_keys", "show"]
