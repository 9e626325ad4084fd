"""Data for every lesson: an offline synthetic image set by default, CIFAR-10 when you have it.

The default set, ``"shapes10"``, is made on the fly from a seed: 3×32×32 images in 10 classes
(the shape of CIFAR-10, so every model and every lesson works on either). Each class is a kind
of pattern — disc, ring, square, cross, stripes in four directions, a checkerboard, a triangle —
drawn at a random place, size and colour over a noisy random background. It needs no network,
takes well under a second to make, is identical on every machine for a given seed, and a small
CNN gets far above chance (10%) within a few seconds on a CPU — all checked in tests/test_data.py.

Everything here returns NumPy arrays (uint8 images, NHWC, like CIFAR-10's files), so PyTorch
(:func:`to_torch`) and TensorFlow (``dpcourse.mirrored``) read the very same numbers.

CIFAR-10 (``load_cifar10``) reads the official "python version" batches. Downloading is an opt-in
(``download=True``) for learners with internet; nothing in the course downloads by default.
Used in lessons 01–06.
"""

from __future__ import annotations

import hashlib
import pickle
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Dataset",
    "load",
    "make_shapes10",
    "load_cifar10",
    "to_torch",
    "normalize",
    "shard_indices",
    "SHAPES10_CLASSES",
    "CIFAR10_CLASSES",
]

SHAPES10_CLASSES = (
    "disc", "ring", "square", "cross", "h-stripes",
    "v-stripes", "diag-stripes", "anti-diag-stripes", "checker", "triangle",
)
CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
_CIFAR10_DIR = "cifar-10-batches-py"


@dataclass
class Dataset:
    """Train and test arrays: images uint8 (N, 32, 32, 3), labels int64 (N,)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: tuple[str, ...]

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"image={tuple(self.x_train.shape[1:])}, classes={self.num_classes})")


# --------------------------------------------------------------------------------------------
# shapes10: the offline default
# --------------------------------------------------------------------------------------------


def _class_masks(label: int, yy, xx, size, phase):
    """The pattern of one class as a soft mask in [0, 1]. yy, xx are coordinates relative to
    each image's centre, shaped (n, 32, 32); size and phase are (n, 1, 1)."""
    r = np.sqrt(yy ** 2 + xx ** 2)
    inside = lambda d: np.clip(size - d, 0.0, 1.0)  # noqa: E731 - a 1-pixel soft edge
    period = 2.0 + size / 3.0
    stripes = lambda t: (np.sin(2 * np.pi * t / period + phase) > 0).astype(np.float32)  # noqa: E731
    window = inside(np.maximum(np.abs(yy), np.abs(xx)) * 0.9)
    if label == 0:
        return inside(r)
    if label == 1:
        return inside(r) * np.clip(r - size * 0.55, 0.0, 1.0)
    if label == 2:
        return inside(np.maximum(np.abs(yy), np.abs(xx)) * 1.1)
    if label == 3:
        arm = np.minimum(np.abs(yy), np.abs(xx))
        return inside(np.maximum(np.abs(yy), np.abs(xx))) * np.clip(size * 0.3 - arm, 0.0, 1.0)
    if label == 4:
        return window * stripes(yy)
    if label == 5:
        return window * stripes(xx)
    if label == 6:
        return window * stripes((yy + xx) / np.sqrt(2))
    if label == 7:
        return window * stripes((yy - xx) / np.sqrt(2))
    if label == 8:
        cell = np.maximum(size / 2.5, 2.0)
        return window * ((np.floor(yy / cell) + np.floor(xx / cell)) % 2)
    if label == 9:
        # a triangle, apex down (image rows grow downwards)
        return (np.clip(yy + size * 0.8, 0, 1) * np.clip(size * 0.6 - yy, 0, 1)
                * np.clip((size * 0.6 - yy) * 0.6 - np.abs(xx), 0, 1))
    raise ValueError(label)


def make_shapes10(n: int, seed: int = 0, noise: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images of the shapes10 set and their labels, fully determined by ``seed``.

    Classes are balanced (``n // 10`` each, the remainder spread over the first classes) and
    shuffled. ``noise`` is the standard deviation of the pixel noise, in [0, 1] units.

    Shown in lesson 01, §"The data".
    """
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be a positive number of images, got {n!r}")
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    grid = np.arange(32, dtype=np.float32)
    images = np.empty((n, 32, 32, 3), dtype=np.float32)
    # background: a random, muted colour gradient per image
    bg0 = rng.uniform(0.25, 0.75, size=(n, 1, 1, 3)).astype(np.float32)
    bg1 = rng.uniform(0.25, 0.75, size=(n, 1, 1, 3)).astype(np.float32)
    ramp = (grid[None, :, None, None] / 31.0) * np.ones((1, 1, 32, 1), np.float32)
    images[:] = bg0 * (1 - ramp) + bg1 * ramp
    cy = rng.uniform(10, 22, size=(n, 1, 1)).astype(np.float32)
    cx = rng.uniform(10, 22, size=(n, 1, 1)).astype(np.float32)
    size = rng.uniform(7, 11, size=(n, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, size=(n, 1, 1)).astype(np.float32)
    # the pattern's colour: each channel clearly brighter or darker than the background's
    # average, so the shape always stands out (its colour carries no class information)
    offset = rng.uniform(0.3, 0.5, size=(n, 1, 1, 3)) * rng.choice([-1.0, 1.0], size=(n, 1, 1, 3))
    colour = np.clip((bg0 + bg1) / 2 + offset.astype(np.float32), 0.0, 1.0)
    yy = grid[None, :, None] - cy
    xx = grid[None, None, :] - cx
    for label in range(10):
        idx = np.flatnonzero(labels == label)
        if idx.size == 0:
            continue
        mask = _class_masks(label, yy[idx], xx[idx], size[idx], phase[idx])[..., None]
        images[idx] = images[idx] * (1 - mask) + colour[idx] * mask
    images += rng.normal(0.0, noise, size=images.shape).astype(np.float32)
    return (np.clip(images, 0.0, 1.0) * 255).round().astype(np.uint8), labels


# --------------------------------------------------------------------------------------------
# CIFAR-10: when the learner has it
# --------------------------------------------------------------------------------------------


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path} is not a CIFAR-10 batch: data has shape {data.shape}, "
                         f"expected (N, 3072)")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # stored planar: R, G, B
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    return np.ascontiguousarray(images), labels


def _md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download_cifar10(root: Path) -> None:
    archive = root / "cifar-10-python.tar.gz"
    if not archive.exists():
        root.mkdir(parents=True, exist_ok=True)
        print(f"downloading CIFAR-10 (170 MB) to {archive} ...")
        tmp = archive.with_suffix(".part")
        try:
            urllib.request.urlretrieve(CIFAR10_URL, tmp)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"could not download CIFAR-10 from {CIFAR10_URL} ({exc}). Without "
                               f"internet, use the default data set: data.load('shapes10').") from None
        tmp.rename(archive)
    if _md5(archive) != CIFAR10_MD5:
        raise RuntimeError(f"{archive} is damaged (its MD5 does not match); delete it and retry.")
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(root, filter="data")


def load_cifar10(root: str | Path = "~/.cache/dpcourse", download: bool = False,
                 n_train: int | None = None, n_test: int | None = None) -> Dataset:
    """CIFAR-10 from ``root/cifar-10-batches-py`` (the official python version).

    With ``download=True`` the archive is fetched (170 MB, needs internet) and checked first.
    ``n_train`` / ``n_test`` keep only the first images, for quick runs.
    """
    root = Path(root).expanduser()
    folder = root / _CIFAR10_DIR
    if not (folder / "test_batch").exists():
        if not download:
            raise FileNotFoundError(
                f"CIFAR-10 is not in {folder}. Pass download=True (needs internet, 170 MB), or "
                f"unpack cifar-10-python.tar.gz into {root} - or use the offline default "
                f"data set: data.load('shapes10')."
            )
        _download_cifar10(root)
    train = [_read_cifar_batch(folder / f"data_batch_{i}") for i in range(1, 6)
             if (folder / f"data_batch_{i}").exists()]
    if not train:
        raise FileNotFoundError(f"{folder} has a test_batch but no data_batch_1..5")
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    x_test, y_test = _read_cifar_batch(folder / "test_batch")
    return Dataset("cifar10", x_train[:n_train], y_train[:n_train], x_test[:n_test],
                   y_test[:n_test], CIFAR10_CLASSES)


def load(name: str = "shapes10", n_train: int = 6000, n_test: int = 2000, seed: int = 0,
         root: str | Path = "~/.cache/dpcourse", download: bool = False) -> Dataset:
    """The data set a lesson asks for: ``"shapes10"`` (offline, the default) or ``"cifar10"``.

    For shapes10, the test images come from a different seed than the training images, so
    the test accuracy measures generalisation, not memory.
    """
    if name == "shapes10":
        x_train, y_train = make_shapes10(n_train, seed=seed)
        x_test, y_test = make_shapes10(n_test, seed=seed + 10_000)
        return Dataset("shapes10", x_train, y_train, x_test, y_test, SHAPES10_CLASSES)
    if name == "cifar10":
        return load_cifar10(root, download=download, n_train=n_train, n_test=n_test)
    raise ValueError(f"unknown data set {name!r}: choose 'shapes10' (offline) or 'cifar10'")


# --------------------------------------------------------------------------------------------
# Turning arrays into tensors, and splitting them over ranks
# --------------------------------------------------------------------------------------------

# Per-channel statistics are fixed constants, not computed from each shard, so every rank and
# both frameworks normalise identically.
MEAN = np.array([0.5, 0.5, 0.5], dtype=np.float32)
STD = np.array([0.25, 0.25, 0.25], dtype=np.float32)


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 NHWC -> float32 NHWC, centred and scaled (TensorFlow's layout)."""
    return ((images.astype(np.float32) / 255.0) - MEAN) / STD


def to_torch(images: np.ndarray, labels: np.ndarray):
    """A ``torch.utils.data.TensorDataset`` of float32 NCHW images and int64 labels."""
    import torch
    from torch.utils.data import TensorDataset

    x = torch.from_numpy(np.ascontiguousarray(normalize(images).transpose(0, 3, 1, 2)))
    return TensorDataset(x, torch.from_numpy(np.asarray(labels, dtype=np.int64)))


def shard_indices(n: int, rank: int, world_size: int, shuffle: bool = True, seed: int = 0,
                  epoch: int = 0, drop_last: bool = False) -> np.ndarray:
    """The sample indices rank ``rank`` reads in ``epoch`` - the rule DistributedSampler uses.

    Shuffle with (seed + epoch), pad by wrapping around (or drop the tail) so every rank gets
    the same count, then take every ``world_size``-th index starting at ``rank``: the shards
    are disjoint (apart from padding) and together cover the data.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    order = (np.random.default_rng(seed + epoch).permutation(n) if shuffle else np.arange(n))
    if drop_last:
        order = order[: n - n % world_size]
    else:
        pad = (-n) % world_size
        order = np.concatenate([order, order[:pad]])
    return order[rank::world_size]
