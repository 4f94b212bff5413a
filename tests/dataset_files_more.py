"""Writers of the new datasets' real on-disk formats with random content: LEAF JSON (FEMNIST, Shakespeare),
the Tiny-ImageNet folder tree with its annotations file and FLamby's Fed-ISIC2019 layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from fedpcd.data.leaf import SHAKESPEARE_LETTERS


def _leaf_file(path: Path, users: dict[str, tuple[list, list]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(data))


def make_femnist(folder: Path, writers: int = 6, per_writer: tuple[int, int] = (8, 3), seed: int = 0) -> dict:
    """LEAF FEMNIST train/ and test/ (two train files); returns {split: {user: (x, y)}}."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, tuple[list, list]]] = {"train": {}, "test": {}}
    for split, n in zip(("train", "test"), per_writer, strict=True):
        for w in range(writers):
            x = (rng.integers(0, 256, (n, 784)) / 255.0).round(6).tolist()
            y = [int(v) for v in rng.integers(0, 62, n)]
            out[split][f"f{w:04d}_{w % 3}"] = (x, y)
        names = list(out[split])
        half = len(names) // 2 if split == "train" else len(names)
        _leaf_file(folder / split / f"all_data_0_{split}.json", {u: out[split][u] for u in names[:half]})
        if half < len(names):
            _leaf_file(folder / split / f"all_data_1_{split}.json", {u: out[split][u] for u in names[half:]})
    return out


def make_shakespeare(
    folder: Path, roles: int = 5, per_role: tuple[int, int] = (10, 4), seed: int = 0
) -> dict:
    """LEAF Shakespeare train/ and test/: 80-character lines and their next characters."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(SHAKESPEARE_LETTERS))
    out: dict[str, dict[str, tuple[list, list]]] = {"train": {}, "test": {}}
    for split, n in zip(("train", "test"), per_role, strict=True):
        for r in range(roles):
            x = ["".join(rng.choice(letters, 80)) for _ in range(n)]
            y = [str(rng.choice(letters)) for _ in range(n)]
            out[split][f"THE_TRAGEDY_{r}"] = (x, y)
        _leaf_file(folder / split / f"all_data_{split}.json", out[split])
    return out


def _jpeg(path: Path, rng: np.random.Generator, w: int, h: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path, quality=95)


def make_tiny(
    base: Path, classes: int = 4, per_class: int = 3, val: int = 8, side: int = 8, seed: int = 0
) -> list:
    """``base/tiny-imagenet-200`` with ``classes`` wnids (train/<wnid>/images/*.JPEG, <wnid>_boxes.txt),
    ``val`` annotated val images and one unlabelled test image; returns the wnids."""
    rng = np.random.default_rng(seed)
    root = base / "tiny-imagenet-200"
    wnids = [f"n{1000 + 7 * i:08d}" for i in range(classes)]
    root.mkdir(parents=True)
    (root / "wnids.txt").write_text("\n".join(reversed(wnids)) + "\n")  # not sorted: the loader sorts
    (root / "words.txt").write_text("".join(f"{w}\tthing {w}\n" for w in wnids))
    for w in wnids:
        for i in range(per_class):
            _jpeg(root / "train" / w / "images" / f"{w}_{i}.JPEG", rng, side, side)
        (root / "train" / w / f"{w}_boxes.txt").write_text("")
    lines = []
    for i in range(val):
        _jpeg(root / "val" / "images" / f"val_{i}.JPEG", rng, side, side)
        lines.append(f"val_{i}.JPEG\t{wnids[i % classes]}\t0\t0\t{side - 1}\t{side - 1}")
    (root / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    _jpeg(root / "test" / "images" / "test_0.JPEG", rng, side, side)
    return wnids


def make_isic(folder: Path, per_center: tuple[int, int] = (6, 2), seed: int = 0) -> list[dict]:
    """FLamby's layout: ISIC_2019_Training_Input_preprocessed/*.jpg (shorter side 24, not square) and the
    train_test_split CSV; 6 centres with ``per_center`` (train, test) images each; returns the CSV rows."""
    rng = np.random.default_rng(seed)
    images = folder / "ISIC_2019_Training_Input_preprocessed"
    rows = []
    for center in range(6):
        for fold, n in zip(("train", "test"), per_center, strict=True):
            for _ in range(n):
                name = f"ISIC_{len(rows):07d}"
                _jpeg(images / f"{name}.jpg", rng, 30, 24)
                target = int(rng.integers(0, 8))
                rows.append({"image": name, "target": target, "center": center, "fold": fold})
    header = "image,MEL,NV,BCC,AK,BKL,DF,VASC,SCC,UNK,target,center,fold,fold2\n"
    lines = []
    for r in rows:
        onehot = ",".join("1.0" if k == r["target"] else "0.0" for k in range(9))
        lines.append(
            f"{r['image']},{onehot},{r['target']},{r['center']},{r['fold']},{r['fold']}_{r['center']}"
        )
    (folder / "train_test_split").write_text(header + "\n".join(lines) + "\n")
    return rows
