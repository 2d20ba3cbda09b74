"""Converters: raw corpora (COCO, class folders, CIFAR batches, audio folders) into shardkit datasets.

``convert(src, out, kind=None, **options)`` is the entry point; a corpus kind is a
:class:`~shardkit.converters.base.Converter` named in :mod:`~shardkit.converters.registry` or added
through the ``shardkit.converters`` entry points. Nothing here imports torch or tensorflow.
"""

from shardkit.converters.base import Converter, Decoded, Decoder, Note, ScanResult, Skip
from shardkit.converters.options import Option
from shardkit.converters.partrun import convert, run_converter
from shardkit.converters.pipeline import ConvertSummary
from shardkit.converters.registry import available_kinds, detect_kind, get_converter, register

__all__ = [
    "Converter",
    "ConvertSummary",
    "Decoded",
    "Decoder",
    "Note",
    "Option",
    "ScanResult",
    "Skip",
    "available_kinds",
    "convert",
    "detect_kind",
    "get_converter",
    "register",
    "run_converter",
]
