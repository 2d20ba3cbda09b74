"""``show`` and ``export``: look at the records of a dataset, or write them back as PNG / WAV files.

Both read the chosen records with one random-access read. File names are built from the key and
class name with every character outside ``[A-Za-z0-9._-]`` replaced (metadata may hold anything, so
it never chooses a directory), and files are no more readable than the dataset's payload files.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardkit.errors import ConfigError
from shardkit.formats import Batch, Dataset, open_dataset
from shardkit.viz.selection import SELECTION_DEFAULTS, Selection, select_keys
from shardkit.viz.sheet import SheetLayout, as_rgb, contact_sheet

__all__ = ["ShowResult", "show", "export", "is_audio", "file_stem"]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class ShowResult:
    """What :func:`show` wrote: ``path`` (the PNG), ``keys`` (the records shown, in order), ``layout``
    (where each image landed on the sheet; ``None`` for audio) and ``wavs`` (WAV files, with ``wav_dir``)."""

    path: Path
    keys: tuple[int, ...]
    layout: SheetLayout | None = None
    wavs: tuple[Path, ...] = ()


def is_audio(ds: Dataset) -> bool:
    """Whether the dataset's records are audio clips (``[T]`` or ``[T, C]``), not images."""
    return ds.meta.payload == "audio" or "sample_rate" in ds.meta.transform


def _class_name(ds: Dataset, field: str, value: int) -> str:
    names = ds.meta.labels.get(field) or []
    if 0 <= value < len(names):
        return names[value]
    return "no label" if value < 0 else str(value)  # COCO: -1 for an image without boxes


def _caption(ds: Dataset, batch: Batch, i: int) -> str:
    key = int(batch["key"][i])
    return f"#{key}  {_class_name(ds, 'label', int(batch['label'][i]))}" if "label" in batch else f"#{key}"


def file_stem(ds: Dataset, batch: Batch, i: int) -> str:
    """``000012-dog``: a file name for record ``i`` of ``batch`` that cannot leave its directory."""
    key = int(batch["key"][i])
    if "label" not in batch:
        return f"{key:06d}"
    name = _UNSAFE.sub("_", _class_name(ds, "label", int(batch["label"][i]))).strip("._") or "label"
    return f"{key:06d}-{name[:60]}"


def _boxes(ds: Dataset, batch: Batch, i: int) -> tuple[np.ndarray, list[int], list[str]] | None:
    """A COCO-style record's visible boxes, their class ids and names."""
    if not {"boxes", "num_boxes", "box_labels"} <= set(batch):
        return None
    n = int(batch["num_boxes"][i])
    classes = [int(c) for c in batch["box_labels"][i][:n]]
    return batch["boxes"][i][:n], classes, [_class_name(ds, "box_labels", c) for c in classes]


def _rate(ds: Dataset) -> int:
    rate = ds.meta.transform.get("sample_rate")
    if not isinstance(rate, int) or rate <= 0:
        raise ConfigError(f"{ds.path}: the metadata records no sample rate, so the audio cannot be played or plotted")
    return rate


def _same_mode_as_dataset(ds: Dataset, path: Path) -> None:
    """Give ``path`` no more permission than the dataset's payload files have (owner-only for a
    dataset in an object store, whose permissions are not file modes)."""
    mode = 0o600
    if ds.store.is_local and ds.meta.shards:
        try:
            mode = stat.S_IMODE(os.stat(ds.store.local_path(ds.meta.shards[0].path)).st_mode)
        except OSError:
            pass
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & mode & 0o666)


def _read(ds: Dataset, sel: Selection, naming: str) -> Batch:
    keys = select_keys(ds, sel, naming=naming)
    if keys.size == 0:
        raise ConfigError(f"{ds.path}: no record matches (label {sel.label!r})" if sel.label else f"{ds.path}: no records")
    return ds.read(keys)


def show(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    keys: Sequence[int] | None = None,
    random: int | None = None,
    seed: int = SELECTION_DEFAULTS.seed,
    label: str | None = None,
    limit: int = SELECTION_DEFAULTS.limit,
    columns: int | None = None,
    wav_dir: str | os.PathLike[str] | None = None,
    naming: str = "python",
) -> ShowResult:
    """Draw records of the dataset at ``path`` into one PNG: a contact sheet for images (key, class and
    COCO boxes), a waveform and a spectrogram per record for audio (the ``viz`` extra).

    Parameters
    ----------
    path
        Dataset directory.
    out
        PNG to write (default ``<dataset name>-show.png`` in the current directory).
    keys, random, seed, label, limit
        Which records (see :class:`~shardkit.viz.selection.Selection`).
    columns
        Frames per row of a contact sheet (default: about square).
    wav_dir
        Audio only: also write each record as a WAV file there.
    naming
        How errors name options: ``"python"`` or ``"cli"``.
    """
    sel = Selection(keys=keys, random=random, seed=seed, label=label, limit=limit)
    with open_dataset(path) as ds:
        batch = _read(ds, sel, naming)
        target = Path(out) if out is not None else Path(f"{Path(str(ds.path).rstrip('/')).name or 'dataset'}-show.png")
        chosen = tuple(int(k) for k in batch["key"])
        payload = batch[ds.meta.payload]
        captions = [_caption(ds, batch, i) for i in range(len(chosen))]
        target.parent.mkdir(parents=True, exist_ok=True)
        if is_audio(ds):
            from shardkit.viz.audio import audio_figure

            audio_figure(list(payload), captions, _rate(ds), target)
            _same_mode_as_dataset(ds, target)
            wavs = tuple(_export_batch(ds, batch, Path(wav_dir))) if wav_dir is not None else ()
            return ShowResult(target, chosen, None, wavs)
        if wav_dir is not None:
            raise ConfigError(f"{'--wav' if naming == 'cli' else 'wav_dir'}: {ds.path} holds images, not audio")
        found = [_boxes(ds, batch, i) for i in range(len(chosen))]
        boxes = [b for b in found if b is not None]
        try:
            sheet, layout = contact_sheet(list(payload), chosen, captions, boxes if len(boxes) == len(found) else None,
                                          columns=columns)
        except ValueError as exc:
            raise ConfigError(f"{ds.path}: cannot draw records of shape {ds.meta.record.shape}: {exc}") from None
        sheet.save(target, "PNG")
        _same_mode_as_dataset(ds, target)
        return ShowResult(target, chosen, layout)


def _export_batch(ds: Dataset, batch: Batch, out_dir: Path) -> list[Path]:
    from PIL import Image

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    payload = batch[ds.meta.payload]
    audio = is_audio(ds)
    rate = _rate(ds) if audio else 0
    for i in range(len(batch["key"])):
        stem = file_stem(ds, batch, i)
        if audio:
            from shardkit.viz.audio import write_wav

            path = write_wav(payload[i], rate, out_dir / f"{stem}.wav")
        else:
            path = out_dir / f"{stem}.png"
            Image.fromarray(as_rgb(payload[i]), "RGB").save(path, "PNG")
        _same_mode_as_dataset(ds, path)
        written.append(path)
    return written


def export(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    keys: Sequence[int] | None = None,
    random: int | None = None,
    seed: int = SELECTION_DEFAULTS.seed,
    label: str | None = None,
    limit: int = SELECTION_DEFAULTS.limit,
    naming: str = "python",
) -> list[Path]:
    """Write records of the dataset at ``path`` to ``out_dir`` as ``<key>-<class>.png`` (the frame as
    stored) or ``.wav`` (at the dataset's rate), chosen as for :func:`show`; returns the paths in record order."""
    sel = Selection(keys=keys, random=random, seed=seed, label=label, limit=limit)
    with open_dataset(path) as ds:
        batch = _read(ds, sel, naming)
        try:
            return _export_batch(ds, batch, Path(out_dir))
        except ValueError as exc:
            raise ConfigError(f"{ds.path}: cannot export records of shape {ds.meta.record.shape}: {exc}") from None

