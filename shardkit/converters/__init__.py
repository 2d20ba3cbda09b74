"""Converters: raw corpora (COCO, class folders, CIFAR batches, audio folders) into shardkit datasets.

``convert(src, out, kind=None, **options)`` is the entry point; each corpus kind is one module that
registers a :class:`~shardkit.converters.base.Converter` subclass by name. Nothing here imports torch
or tensorflow.
"""

from shardkit.converters.base import (
    Converter,
    ScanResult,
    Skip,
    available_kinds,
    detect_kind,
    get_converter,
    register,
)
from shardkit.converters.pipeline import ConvertSummary, convert, run_converter

__all__ = [
    "Converter",
    "ConvertSummary",
    "ScanResult",
    "Skip",
    "available_kinds",
    "convert",
    "detect_kind",
    "get_converter",
    "register",
    "run_converter",
]
