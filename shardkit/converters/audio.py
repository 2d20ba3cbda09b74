"""Audio class-folder corpora, Speech-Commands style: ``ROOT/<word>/<clip>.{wav,flac,ogg}``.

Splits come from split directories (``ROOT/train/<word>/...``) or from ``validation_list.txt`` /
``testing_list.txt``: ``validation`` (``val``) and ``test`` (``testing``) are the listed files,
``train`` (the default) every other one, ``all`` everything. Record: ``audio`` int16 or float32
``[T]`` or ``[T, C]`` and ``label`` int64; with ``window=True`` a file may give several records.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardkit.converters.audio_transforms import (
    AUDIO_COLUMNS,
    AUDIO_EXTENSIONS,
    MAX_FILE_CHANNELS,
    MAX_RATE,
    MIN_RATE,
    AudioTransform,
)
from shardkit.converters.base import PROVENANCE, RECORD_BYTES_PER_CALL, Decoded, ScanResult
from shardkit.converters.classfolders import ClassFolderConverter, ClassFolderDecoder, choose_split, class_names, find_splits
from shardkit.converters.options import Option, choice, count, duration, flag, rate, text
from shardkit.errors import ConfigError, ConversionError
from shardkit.formats import FieldSpec

__all__ = ["AUDIO_OPTIONS", "AudioFolderConverter", "AudioDecoder"]

_LISTS = {"validation": "validation_list.txt", "test": "testing_list.txt"}
_ALIASES = {"val": "validation", "valid": "validation", "testing": "test"}

_OPTIONS = (
    Option("split", str, None, "Split: a split directory, or with validation_list.txt / testing_list.txt one of "
           "train, validation, test, all (default train).", parse=text, metavar="NAME"),
    Option("sample_rate", int, 16000, f"Output rate in Hz, {MIN_RATE} to {MAX_RATE} (16000, 16k, 44.1kHz).",
           parse=rate(MIN_RATE, MAX_RATE), metavar="HZ"),
    Option("duration", float, 1.0, "Record length in seconds (1, 2.5s, 500ms).", parse=duration, metavar="SECONDS"),
    Option("channels", int, 1, f"1 mixes to mono; C (up to {MAX_FILE_CHANNELS}) keeps C channels.",
           parse=count(1, MAX_FILE_CHANNELS), metavar="C"),
    Option("window", bool, False, "Cut long files into several records instead of trimming them.", parse=flag),
    Option("dtype", str, "int16", "Sample type: int16 or float32.", parse=choice("int16", "float32"), metavar="TYPE"),
)
#: The audio transform's options (every one but ``split``), for other kinds with audio records.
AUDIO_OPTIONS = _OPTIONS[1:]


class AudioDecoder(ClassFolderDecoder):
    """Decode one ``(path, label)`` item into fixed-length records, a bounded number per call."""

    def __init__(self, base: Path, audio: AudioTransform) -> None:
        super().__init__("audio", FieldSpec(audio.shape, audio.dtype), base, frozenset(AUDIO_EXTENSIONS), "audio")
        self.audio = audio
        self.per_call = max(1, RECORD_BYTES_PER_CALL // audio.record_nbytes)

    def decode(self, item: tuple[str, int], start: int = 0) -> Decoded:
        rel, label = item
        clips = self.audio.read(self.checked_path(rel), start, self.per_call)
        source = clips.provenance()
        return Decoded([{"audio": clip, "label": np.int64(label), PROVENANCE: source} for clip in clips.records],
                       start, clips.more)


class AudioFolderConverter(ClassFolderConverter):
    """Convert class folders of audio clips into fixed-length records."""

    name = "audio"
    payload = "audio"
    media_extensions = frozenset(AUDIO_EXTENSIONS)
    media_name = "audio"
    options = _OPTIONS
    chunk_size = 16
    progress_unit = "file"
    provenance_columns = AUDIO_COLUMNS

    def __init__(self, src: str | Path, **options: Any) -> None:
        super().__init__(src, **options)
        v = self.values
        if round(v["duration"] * v["sample_rate"]) < 1:
            raise ConfigError(
                f"{self.label('duration')} {v['duration']} at {self.label('sample_rate')} {v['sample_rate']} "
                "is less than one sample"
            )
        self.audio = AudioTransform(v["sample_rate"], v["duration"], v["channels"], v["window"], v["dtype"])

    def layout(self) -> tuple[str | None, Path, list[str]]:
        self.lists = {name: self.src / f for name, f in _LISTS.items() if (self.src / f).is_file()}
        split_dirs = find_splits(self.src)
        requested = self.values.get("split")
        self.list_mode = bool(self.lists) and not split_dirs
        if self.list_mode:
            split = _ALIASES.get(requested, requested) if requested else "train"
            if split not in ("train", "validation", "test", "all"):
                raise ConfigError(
                    f"{self.src}: {self.label('split')} expected train, validation, test or all, found {requested!r}"
                )
            return split, self.src, class_names(self.src, [])
        split = choose_split(split_dirs, requested, self.src, self.label("split"))
        return split, self.src / split if split else self.src, class_names(self.src, split_dirs)

    def _listed(self, name: str) -> set[str]:
        path = self.lists.get(name)
        if path is None:
            return set()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConversionError(f"{path}: cannot read the split list: {exc}") from None
        return {line.strip().replace("\\", "/") for line in text.splitlines() if line.strip()}

    def scan(self) -> ScanResult:
        items = self.scan_files()
        if self.list_mode and self.split != "all":
            val, test = self._listed("validation"), self._listed("test")
            if self.split == "validation":
                items = [it for it in items if it[0] in val]
            elif self.split == "test":
                items = [it for it in items if it[0] in test]
            else:
                items = [it for it in items if it[0] not in val and it[0] not in test]
        if not items:
            raise ConversionError(f"{self.base}: no files for split {self.split!r}")
        return ScanResult(items=items)

    def media_transform(self) -> AudioTransform:
        return self.audio

    def record_spec(self) -> FieldSpec:
        return FieldSpec(self.audio.shape, self.audio.dtype)

    def make_decoder(self) -> AudioDecoder:
        return AudioDecoder(self.base, self.audio)
