"""Datasets of JPEG files, read with Pillow: Tiny-ImageNet's folder tree and FLamby's Fed-ISIC2019.

Tiny-ImageNet (Stanford CS231n): ``tiny-imagenet-200/`` holds ``wnids.txt`` (the 200 WordNet ids),
``train/<wnid>/images/*.JPEG`` (500 per class) and ``val/images/*.JPEG`` with ``val/val_annotations.txt``
(tab-separated: file name, wnid, bounding box). The labelled val split is the test set (the test split has no
labels); classes are the sorted wnids (ImageFolder's order). Downloaded as the official zip, checked by MD5.

Fed-ISIC2019 (FLamby, Ogier du Terrail et al., NeurIPS 2022 Datasets and Benchmarks): FLamby's
``resize_images.py`` writes ``ISIC_2019_Training_Input_preprocessed/<image>.jpg`` (shorter side 224 px, colour
constancy); its ``train_test_split`` CSV (shipped in FLamby's repository, columns ``image, ..., target,
center, fold, fold2``) gives each image's class 0..7, centre 0..5 and split. Images are centre-cropped to
200 x 200 (FLamby's test-time crop) and every centre is a natural client. The ISIC archive needs its licence
accepted, so nothing is downloaded here.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fedpcd.data.sources import ISIC_IMAGES, isic_split_file
from fedpcd.errors import UserError, clip
from fedpcd.utils import read_user_text, show_path

TINY_MD5 = "90528d7ca1a48142e341f4ef8d21d0de"  # of the zip, as torchvision-style loaders check it

ISIC_CLASSES = 8
ISIC_CENTERS = 6
ISIC_SIDE = 200


def read_image(path: Path, side: int | None = None) -> np.ndarray:
    """One image as uint8 RGB ``[3, H, W]``; with ``side``: scaled so its shorter side is at least ``side``,
    then centre-cropped to ``side x side``. An unreadable file is a one-line UserError naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            rgb = img.convert("RGB")
    except (OSError, UnidentifiedImageError, ValueError) as exc:
        raise UserError(f"cannot read image {show_path(path)}: {clip(str(exc))}") from None
    if side is not None:
        w, h = rgb.size
        if min(w, h) < side:
            scale = side / min(w, h)
            rgb = rgb.resize((max(side, round(w * scale)), max(side, round(h * scale))), Image.BILINEAR)
            w, h = rgb.size
        left, top = (w - side) // 2, (h - side) // 2
        rgb = rgb.crop((left, top, left + side, top + side))
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)


def stack_images(paths: Sequence[Path], side: int | None = None) -> np.ndarray:
    """``read_image`` of every path, stacked ``[N, 3, H, H]``; images of different sizes (without ``side``)
    or non-square ones are a UserError naming the first that differs."""
    if not paths:
        return np.zeros((0, 3, side or 1, side or 1), dtype=np.uint8)
    first = read_image(paths[0], side)
    if first.shape[1] != first.shape[2]:
        raise UserError(
            f"image {show_path(paths[0])} is {first.shape[2]}x{first.shape[1]}; expected square images"
        )
    out = np.empty((len(paths), *first.shape), dtype=np.uint8)
    out[0] = first
    for i, path in enumerate(paths[1:], start=1):
        img = read_image(path, side)
        if img.shape != first.shape:
            raise UserError(
                f"image {show_path(path)} is {img.shape[2]}x{img.shape[1]}, unlike the others "
                f"({first.shape[2]}x{first.shape[1]})"
            )
        out[i] = img
    return out


# ----- Tiny-ImageNet


def read_tiny(folder: Path) -> tuple[dict[str, torch.Tensor], int]:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` of a Tiny-ImageNet folder (the val split as test),
    and the number of classes (the wnids listed)."""
    wnids = sorted(
        {w.strip() for w in read_user_text(folder / "wnids.txt", "Tiny-ImageNet").split() if w.strip()}
    )
    if not wnids:
        raise UserError(f"{show_path(folder / 'wnids.txt')} lists no classes")
    label = {w: i for i, w in enumerate(wnids)}
    train_paths: list[Path] = []
    train_y: list[int] = []
    for w in wnids:
        files = sorted((folder / "train" / w / "images").glob("*.JPEG"))
        if not files:
            raise UserError(
                f"Tiny-ImageNet class {w}: no images in {show_path(folder / 'train' / w / 'images')}"
            )
        train_paths += files
        train_y += [label[w]] * len(files)
    notes = folder / "val" / "val_annotations.txt"
    test_paths: list[Path] = []
    test_y: list[int] = []
    for n, line in enumerate(read_user_text(notes, "Tiny-ImageNet").splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) < 2 or parts[1] not in label:
            raise UserError(
                f"{show_path(notes)} line {n}: expected '<file>\\t<wnid>\\t...' with a wnid of wnids.txt, "
                f"got {clip(line, 60)!r}"
            )
        test_paths.append(folder / "val" / "images" / parts[0])
        test_y.append(label[parts[1]])
    if not test_paths:
        raise UserError(f"{show_path(notes)} lists no images")
    tensors = {
        "train_x": torch.from_numpy(stack_images(train_paths)),
        "train_y": torch.tensor(train_y, dtype=torch.int64),
        "test_x": torch.from_numpy(stack_images(test_paths)),
        "test_y": torch.tensor(test_y, dtype=torch.int64),
    }
    return tensors, len(wnids)


# ----- Fed-ISIC2019 (FLamby)


def read_isic(folder: Path) -> dict[str, torch.Tensor]:
    """``train_x``, ``train_y``, ``test_x``, ``test_y`` and the centre of every sample (``*_groups``) of a
    FLamby Fed-ISIC2019 folder; images centre-cropped to ``ISIC_SIDE``."""
    split = isic_split_file(folder)
    assert split is not None
    rows = list(csv.DictReader(read_user_text(split, "Fed-ISIC2019 split file").splitlines()))
    needed = {"image", "target", "center", "fold"}
    if not rows or not needed <= set(rows[0]):
        raise UserError(f"{show_path(split)}: expected a CSV with columns {', '.join(sorted(needed))}")
    parts: dict[str, tuple[list[Path], list[int], list[int]]] = {"train": ([], [], []), "test": ([], [], [])}
    for n, row in enumerate(rows, start=2):
        try:
            target, center = int(row["target"]), int(row["center"])
        except (TypeError, ValueError):
            raise UserError(f"{show_path(split)} line {n}: target and center must be integers") from None
        if row["fold"] not in parts or not 0 <= target < ISIC_CLASSES or not 0 <= center < ISIC_CENTERS:
            raise UserError(
                f"{show_path(split)} line {n}: expected fold train/test, target 0..{ISIC_CLASSES - 1} and "
                f"center 0..{ISIC_CENTERS - 1}"
            )
        paths, ys, centers = parts[row["fold"]]
        paths.append(folder / ISIC_IMAGES / f"{row['image']}.jpg")
        ys.append(target)
        centers.append(center)
    out: dict[str, torch.Tensor] = {}
    for s, (paths, ys, centers) in parts.items():
        out[f"{s}_x"] = torch.from_numpy(stack_images(paths, ISIC_SIDE))
        out[f"{s}_y"] = torch.tensor(ys, dtype=torch.int64)
        out[f"{s}_groups"] = torch.tensor(centers, dtype=torch.int64)
    return out
