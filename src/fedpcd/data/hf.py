"""Hugging Face datasets as fedpcd datasets: ``dataset.name: hf:<hub name>`` (``hf:uoft-cs/cifar10``).

A dataset is looked up offline first: a folder written by ``datasets``' ``save_to_disk`` (a DatasetDict,
its ``dataset_dict.json`` beside one folder per split) in ``dataset.root`` itself or under it, then in
``$FEDPCD_DATA`` and ``~/.cache/fedpcd``, each also at ``<folder>/<owner>/<name>``,
``<folder>/<owner>___<name>`` and ``<folder>/<name>``; then the Hugging Face cache through
``datasets.load_dataset`` (the hub names are those of Flower Datasets' ``FederatedDataset``), which downloads
only with ``dataset.download: true`` (otherwise it runs in the hub's offline mode).

Splits: ``train`` and the first of ``test``, ``validation``, ``valid``, ``val``. A folder that holds one
split (``save_to_disk`` of a ``Dataset``, not a ``DatasetDict``) is split here (:func:`carve_test`): of each
class, 1/6 of its samples (rounded, at least one where it has two or more) drawn with a fixed seed (0, not
the run's: the data are the same for every run) are the test set, the rest the training set. The image
column is the only ``Image`` feature or the one named ``image`` / ``img`` (``dataset.image_column``
chooses); the label column the only ``ClassLabel`` or the first of ``label``, ``fine_label``, ``labels``
(``dataset.label_column``).
Images (``Image`` features, or uint8 / [0, 1] float arrays ``[H, W]``, ``[H, W, C]`` or ``[C, H, W]``)
become uint8 ``[N, C, H, H]``: grey when the first training image is grey, RGB otherwise; all must be square
and of one size. Labels become int64 class ids: a ``ClassLabel``'s own, integers as they are, text sorted.
The decoded images of a split are kept in ``~/.cache/fedpcd/hf/`` (a .pt file named by the dataset, the split
and its ``datasets`` fingerprint), so only the first load decodes them. Colour sets are augmented at train
time like the built-in ones (random crop and flip), grey ones are not; the normalisation is measured on the
train images (``channel_stats``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from fedpcd.catalog import HF_INSTALL, HF_PREFIX, check_hf_name
from fedpcd.data.files import find_or_download
from fedpcd.data.sources import Source, cache_dir
from fedpcd.data.tensors import Dataset, Loader, channel_stats
from fedpcd.errors import UserError, clip, reraise_interrupt
from fedpcd.utils import atomic_write, show_path

IMAGE_COLUMNS = ("image", "img")
LABEL_COLUMNS = ("label", "fine_label", "labels")
TEST_SPLITS = ("test", "validation", "valid", "val")
CACHE_FORMAT = 1  # raised when the cached tensors change meaning: older files are then never read
DECODE_BATCH = 1024
LOG = logging.getLogger("fedpcd.data")


def require(module: str, user: str) -> ModuleType:
    """Import ``module`` (of ``datasets`` or ``flwr_datasets``), else the one line saying that ``user`` (a
    dataset, a partition scheme) needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UserError(f"{user} needs the {module.split('.')[0]} package: {HF_INSTALL}") from None


def hf_loader(name: str) -> Loader:
    """The loader of dataset ``hf:<hub name>`` (what ``DATASETS.get`` returns for such a name); it also takes
    ``image_column`` and ``label_column``. Checks the name, and that ``datasets`` is installed, at once."""
    hub = check_hf_name(name)

    def load_hf(
        root: Path | None, download: bool, image_column: str | None = None, label_column: str | None = None
    ) -> Dataset:
        return load_hub_dataset(hub, root, download, image_column, label_column)

    load_hf.__qualname__ = load_hf.__name__ = load_hub_dataset.__name__  # what `fedpcd list` names
    load_hf.__doc__ = (
        f"{hub} from the Hugging Face Hub (Lhoest et al., EMNLP 2021 demos, the datasets library): images "
        "and class labels of its train and test splits, from a save_to_disk folder or the Hugging Face cache."
    )
    return load_hf


def load_hub_dataset(
    hub: str,
    root: Path | None,
    download: bool,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Dataset:
    """Dataset ``hf:<hub>`` in memory (see the module docstring for the lookup, columns and conversion)."""
    name = HF_PREFIX + hub
    splits = _open(hub, root, download)
    if not hasattr(splits, "keys"):  # one split saved: the test split carved from it
        label = _column(name, splits, label_column, LABEL_COLUMNS, "label", _is_class_label)
        held = carve_test(np.asarray(splits.with_format("numpy")[label]).astype(str))
        rest = np.setdiff1d(np.arange(len(splits)), held)
        splits = {"train": splits.select(rest), "test": splits.select(held)}
    train_split, test_split = _pick_splits(name, list(splits))
    train, test = splits[train_split], splits[test_split]
    image = _column(name, train, image_column, IMAGE_COLUMNS, "image", _is_image)
    label = _column(name, train, label_column, LABEL_COLUMNS, "label", _is_class_label)
    missing = [c for c in (image, label) if c not in test.column_names]
    if missing:
        raise UserError(
            f"{name}: split {test_split!r} has no column {missing[0]!r}; its columns: {_cols(test)}"
        )
    mode = _image_mode(name, train, image)
    train_x, stats = _images(name, train_split, train, image, mode)
    test_x, _ = _images(name, test_split, test, image, mode)
    if train_x.shape[1:] != test_x.shape[1:]:
        raise UserError(
            f"{name}: train images are {_shape(train_x)} but {test_split} images {_shape(test_x)}; "
            "fedpcd needs one image size"
        )
    train_y, test_y, num_classes = _labels(name, train, test, label)
    mean, std = stats
    return Dataset(
        name=name,
        train_x=train_x,
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
        mean=mean,
        std=std,
        augment=train_x.shape[1] == 3,
    )


TEST_FRACTION = 1 / 6  # of each class, held out as the test set of a dataset saved as one split
CARVE_SEED = 0  # the draw of those samples: fixed, so every run sees the same split


def carve_test(labels: np.ndarray) -> np.ndarray:
    """The sorted indices of the test set carved from a single split with ``labels``: of each class (in
    sorted order), round(n_c * TEST_FRACTION) of its samples, at least one of a class of two or more, drawn
    with ``np.random.default_rng(CARVE_SEED)``; the rest is the training set."""
    rng = np.random.default_rng(CARVE_SEED)
    held = []
    for cls in np.unique(labels):
        idx = np.flatnonzero(labels == cls)
        take = max(round(len(idx) * TEST_FRACTION), 1) if len(idx) > 1 else 0
        held.append(rng.permutation(idx)[:take])
    return np.sort(np.concatenate(held)) if held else np.zeros(0, dtype=np.int64)


# ----- finding the data


def has_saved_dataset(folder: Path) -> Path | None:
    """``folder`` if ``datasets``' ``save_to_disk`` wrote a DatasetDict (``dataset_dict.json``) or a single
    split (``state.json`` beside ``dataset_info.json``) there (a ``find_or_download`` probe)."""
    split = (folder / "state.json").is_file() and (folder / "dataset_info.json").is_file()
    return folder if (folder / "dataset_dict.json").is_file() or split else None


@contextmanager
def _hub_offline(offline: bool) -> Iterator[None]:
    """The hub's offline mode (HF_HUB_OFFLINE) for the calls inside, whatever the environment said when
    ``datasets`` was imported: ``datasets.load_dataset`` then reads its cache and never the network (and its
    warning that it does so is not shown)."""
    if not offline:
        yield
        return
    import datasets
    import huggingface_hub.constants as hub_constants

    log = logging.getLogger("datasets")
    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE, log.level
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE, level = saved
        log.setLevel(level)


def _open(hub: str, root: Path | None, download: bool) -> Any:
    """The DatasetDict of ``hub``: a saved folder, else the Hugging Face cache (the hub with ``download``)."""
    datasets = require("datasets", f"dataset {HF_PREFIX + hub!r}")
    owner_name = hub.replace("/", "___")
    source = Source(
        hub,
        has_saved_dataset,
        "the folder that datasets' save_to_disk writes (of a DatasetDict or of one split)",
        subdirs=(owner_name, hub.rsplit("/", 1)[-1]),
        downloadable=False,
        url=f"https://huggingface.co/datasets/{hub}",
    )
    try:
        folder = find_or_download(source, root, False)
    except UserError as missing:
        cache = show_path(datasets.config.HF_DATASETS_CACHE)
        try:
            with _hub_offline(not download):
                return datasets.load_dataset(hub)
        except Exception as exc:  # not cached, no network, no such dataset: all end in the same advice
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            how = "download disabled" if not download else f"download failed: {clip(first, 160)}"
            raise UserError(f"hf:{missing}; nor is it in the Hugging Face cache {cache} ({how})") from None
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:  # a damaged folder: missing arrow files, bad JSON
        raise UserError(f"cannot read the saved dataset {show_path(folder)}: {clip(str(exc))}") from None
    return loaded  # a DatasetDict, or a Dataset (one split: load_hub_dataset carves the test split)


def _pick_splits(name: str, splits: list[str]) -> tuple[str, str]:
    test = next((s for s in TEST_SPLITS if s in splits), None)
    if "train" not in splits or test is None:
        raise UserError(
            f"{name} has the splits {', '.join(splits) or '(none)'}; fedpcd needs 'train' and one of "
            f"{', '.join(TEST_SPLITS)}"
        )
    return "train", test


def _cols(part: Any) -> str:
    return ", ".join(part.column_names)


def _is_image(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Image)


def _is_class_label(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.ClassLabel)


def _column(name: str, part: Any, chosen: str | None, usual: tuple[str, ...], what: str, typed: Any) -> str:
    """The image or label column: ``chosen``, else the only column of the typical feature type, else the first
    of the usual names; several candidates or none is a one-line UserError naming the columns."""
    key = f"dataset.{what}_column"
    if chosen is not None:
        if chosen not in part.column_names:
            raise UserError(f"{name} has no column {chosen!r} ({key}); its columns: {_cols(part)}")
        return chosen
    typical = [c for c, f in part.features.items() if typed(f)]
    if len(typical) == 1:
        return typical[0]
    pool = typical or part.column_names
    found = next((c for c in usual if c in pool), None)
    if found is not None:
        return found
    if len(typical) > 1:
        raise UserError(
            f"{name}: several {what} columns ({', '.join(typical)}); choose one with {key}=<column> "
            f"(its columns: {_cols(part)})"
        )
    raise UserError(
        f"{name}: no {what} column found (looked for {', '.join(usual)}); name it with {key}=<column> "
        f"(its columns: {_cols(part)})"
    )


# ----- images


def _image_mode(name: str, part: Any, column: str) -> str | None:
    """``L`` or ``RGB`` for an ``Image`` column (from the first training image), None for an array column."""
    if not _is_image(part.features[column]):
        return None
    if len(part) == 0:
        raise UserError(f"{name}: the train split is empty")
    first = part[0][column]
    return "L" if first.mode in ("1", "L", "LA", "I", "I;16", "F") else "RGB"


def _shape(x: torch.Tensor) -> str:
    return "x".join(str(s) for s in x.shape[1:])


def _cache_file(name: str, split: str, part: Any, column: str, mode: str | None) -> Path:
    """``~/.cache/fedpcd/hf/<owner>___<name>/<split>-<key>.pt``, the key hashing the split's fingerprint, the
    column, the image mode and :data:`CACHE_FORMAT`."""
    fingerprint = getattr(part, "_fingerprint", None) or repr(part.cache_files)
    key = hashlib.sha256(f"{CACHE_FORMAT}\0{fingerprint}\0{column}\0{mode}".encode()).hexdigest()[:16]
    slug = name.removeprefix(HF_PREFIX).replace("/", "___")
    safe_split = re.sub(r"[^\w.-]", "_", split)
    return cache_dir() / "hf" / slug / f"{safe_split}-{key}.pt"


def _images(
    name: str, split: str, part: Any, column: str, mode: str | None
) -> tuple[torch.Tensor, tuple[tuple[float, ...], tuple[float, ...]]]:
    """The split's images as uint8 ``[N, C, H, H]`` and their ``channel_stats``: from the cache, else decoded
    once and cached (a cache that cannot be written is a warning; the images are used anyway)."""
    path = _cache_file(name, split, part, column, mode)
    if path.is_file():
        try:
            cached = torch.load(path, weights_only=True)
            x = cached["x"]
            if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and len(x) == len(part):
                return x, (tuple(cached["mean"]), tuple(cached["std"]))
        except Exception as exc:  # a damaged or foreign file: decoded again and replaced
            reraise_interrupt(exc)  # a Ctrl-C during the read, which torch reports as its own error
    LOG.info("%s: decoding the %d images of split %r once (cached in %s)", name, len(part), split, path)
    x = _decode(name, split, part, column, mode)
    mean, std = channel_stats(x)
    try:
        atomic_write(path, lambda fh: torch.save({"x": x, "mean": list(mean), "std": list(std)}, fh), "wb")
    except UserError as exc:
        LOG.warning("%s: images not cached (%s); they are decoded again next time", name, exc)
    return x, (mean, std)


def _decode(name: str, split: str, part: Any, column: str, mode: str | None) -> torch.Tensor:
    """Every image of the split's ``column``, uint8 ``[N, C, H, H]``, decoded in batches."""
    import datasets

    if mode is not None:
        part = part.cast_column(column, datasets.Image(mode=mode))
    rows = part.select_columns([column]).with_format("numpy")
    out: np.ndarray | None = None
    start = 0
    for batch in rows.iter(batch_size=DECODE_BATCH):
        arr = _as_nchw(name, split, batch[column], start)
        if out is None:
            out = np.empty((len(part), *arr.shape[1:]), dtype=np.uint8)
        elif arr.shape[1:] != out.shape[1:]:
            raise _size_error(name, split, out.shape[1:], arr.shape[1:], start)
        out[start : start + len(arr)] = arr
        start += len(arr)
    if out is None:
        raise UserError(f"{name}: split {split!r} is empty")
    if out.shape[2] != out.shape[3]:
        raise UserError(
            f"{name}: images are {out.shape[3]}x{out.shape[2]} (width x height); fedpcd needs square images "
            "of one size: crop or resize them (datasets' map) and save_to_disk"
        )
    return torch.from_numpy(out)


def _size_error(name: str, split: str, want: tuple, got: tuple, start: int) -> UserError:
    return UserError(
        f"{name}: split {split!r} mixes image sizes (C x H x W {'x'.join(map(str, want))} and "
        f"{'x'.join(map(str, got))}, from sample {start} on); fedpcd needs one size: resize them (datasets' "
        "map) and save_to_disk"
    )


def _as_nchw(name: str, split: str, arr: Any, start: int) -> np.ndarray:
    """A decoded batch as uint8 ``[B, C, H, W]``: ``[B, H, W]`` is grey, ``[B, H, W, C]`` channels-last when
    C <= 4 < W, else ``[B, C, H, W]``; floats in [0, 1] are scaled to 0..255."""
    if isinstance(arr, list) or arr.dtype == object:
        shapes = [np.shape(a) for a in arr]
        first = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise _size_error(name, split, shapes[0], shapes[first], start + first)
    if arr.ndim == 3:
        arr = arr[:, None]
    elif arr.ndim == 4 and arr.shape[3] <= 4 < arr.shape[2]:
        arr = arr.transpose(0, 3, 1, 2)
    elif arr.ndim != 4 or arr.shape[1] > 4:
        raise UserError(
            f"{name}: split {split!r} holds arrays of shape {arr.shape[1:]}; expected images [H, W], "
            "[H, W, C] or [C, H, W] with C <= 4"
        )
    if arr.dtype == np.uint8:
        return arr
    if np.issubdtype(arr.dtype, np.integer) and arr.size and arr.min() >= 0 and arr.max() <= 255:
        return arr.astype(np.uint8)
    if np.issubdtype(arr.dtype, np.floating) and arr.size and arr.min() >= 0.0 and arr.max() <= 1.0:
        return np.rint(arr * 255.0).astype(np.uint8)
    raise UserError(
        f"{name}: split {split!r} holds {arr.dtype} pixel values outside 0..255 (integers) and 0..1 (floats)"
    )


# ----- labels


def _labels(name: str, train: Any, test: Any, column: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Train and test labels as int64 class ids, and the number of classes."""
    feature = train.features[column]
    values = [np.asarray(part.with_format("numpy")[column]) for part in (train, test)]
    if _is_class_label(feature):
        num_classes = int(feature.num_classes)
    elif all(v.dtype.kind in "OUS" for v in values):  # text labels: ids in sorted order
        classes, ids = np.unique(np.concatenate(values).astype(str), return_inverse=True)
        values = np.split(ids.reshape(-1), [len(values[0])])
        num_classes = len(classes)
    elif all(v.dtype.kind in "iub" for v in values):
        num_classes = int(max((v.max() for v in values if v.size), default=-1)) + 1
    else:
        raise UserError(f"{name}: column {column!r} holds {values[0].dtype} values, not class labels")
    for v in values:
        if v.ndim != 1:
            raise UserError(f"{name}: column {column!r} holds arrays, not one class label per sample")
        if v.size and (v.min() < 0 or v.max() >= num_classes):
            raise UserError(
                f"{name}: column {column!r} holds label {int(v.min() if v.min() < 0 else v.max())}, outside "
                f"0..{num_classes - 1} (a negative label marks a sample without one: filter them out and "
                "save_to_disk)"
            )
    train_y, test_y = (torch.from_numpy(v.astype(np.int64)) for v in values)
    return train_y, test_y, num_classes
