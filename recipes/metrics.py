"""Sample quality without Inception weights: a small CNN trained once on the train split gives features
for a Fréchet distance (FID's formula in its 128-d penultimate layer) and a classifier accuracy on
class-conditional samples. Both are read against the held-out test split, never the training images.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from recipes.data import Dataset, cache_dir

ARCH_VERSION = 1  # bump when Classifier changes, so stale cached weights are not reused
EPOCHS = {"mnist": 8, "synthetic": 4}  # the synthetic gratings separate in a few dozen steps


class Classifier(nn.Module):
    """Four conv stages (32 -> 4 px) and global average pooling to 128 features, then a linear head.
    Small enough to train in seconds on CPU; the features are what the Fréchet distance compares."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        widths = [in_channels, 16, 32, 64, 128]
        stages = []
        for i, (cin, cout) in enumerate(zip(widths, widths[1:])):
            stages += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.GELU()]
            if i < len(widths) - 2:
                stages.append(nn.MaxPool2d(2))
        self.body = nn.Sequential(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(widths[-1], num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _fingerprint(dataset: Dataset, epochs: int) -> str:
    """Cache key: the exact images and labels, the architecture version and the schedule."""
    digest = hashlib.sha1(f"{ARCH_VERSION}:{epochs}:{dataset.num_classes}".encode())
    for part in (dataset.train.images, dataset.train.labels, dataset.test.images, dataset.test.labels):
        digest.update(part.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def _shift(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random translation by up to 2 px (background -1 fills), so the features do not overfit 4500 digits."""
    dy, dx = (int(v) for v in torch.randint(-2, 3, (2,), generator=generator))
    return torch.roll(F.pad(x, (2, 2, 2, 2), value=-1.0), (dy, dx), dims=(2, 3))[..., 2:-2, 2:-2]


def train_classifier(dataset: Dataset, device: torch.device | str, epochs: int, batch: int = 128) -> Classifier:
    """Adam on the train split with a fixed seed; leaves the caller's global RNG untouched."""
    devices = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        net = Classifier(dataset.shape[0], dataset.num_classes).to(device)
        gen = torch.Generator().manual_seed(0)
        images, labels = dataset.train.images.to(device), dataset.train.labels.to(device)
        opt = torch.optim.Adam(net.parameters(), lr=2e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, 2e-3, total_steps=epochs * (len(labels) // batch))
        net.train()
        bar = tqdm(range(epochs), desc="training the FD classifier (once; then cached)", unit="epoch", leave=False,
                   disable=None)
        for _ in bar:
            order = torch.randperm(len(labels), generator=gen).to(device)
            for start in range(0, len(labels) - batch + 1, batch):
                idx = order[start:start + batch]
                loss = F.cross_entropy(net(_shift(images[idx], gen)), labels[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                schedule.step()
    return net.eval().requires_grad_(False)


@torch.no_grad()
def accuracy(net: Classifier, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Fraction of images net labels correctly."""
    hits = sum((net(images[i:i + batch].float()).argmax(1) == labels[i:i + batch]).sum().item()
               for i in range(0, len(labels), batch))
    return hits / len(labels)


@torch.no_grad()
def features(net: Classifier, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Penultimate features (N, 128) in float64, ready for moments."""
    chunks = images.split(batch)
    return torch.cat([net.features(chunk.float()).double() for chunk in chunks])


def classifier_path(dataset: Dataset, cache: str | os.PathLike | None = None) -> Path:
    """Where ``load_classifier`` keeps the feature network for dataset. A study that merges runs made on
    different machines puts one file here on each, so that every run's FD is measured in the same features
    (a classifier trained again on a GPU is not bit-identical)."""
    return cache_dir(cache) / f"classifier_{dataset.name}_{_fingerprint(dataset, EPOCHS[dataset.name])}.pt"


def load_classifier(dataset: Dataset, device: torch.device | str,
                    cache: str | os.PathLike | None = None) -> tuple[Classifier, float]:
    """The feature network for dataset and its test accuracy: from the cache, else trained and cached."""
    path = classifier_path(dataset, cache)
    net = Classifier(dataset.shape[0], dataset.num_classes)
    if path.exists():
        stored = torch.load(path, map_location="cpu", weights_only=True)
        net.load_state_dict(stored["state_dict"])
        return net.to(device).eval().requires_grad_(False), float(stored["test_accuracy"])
    net = train_classifier(dataset, device, EPOCHS[dataset.name])
    test_accuracy = accuracy(net, dataset.test.images.to(device), dataset.test.labels.to(device))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {k: v.cpu() for k, v in net.state_dict().items()}
    torch.save({"state_dict": state, "test_accuracy": test_accuracy}, tmp)
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return net, test_accuracy


def moments(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean (D,) and unbiased covariance (D, D) of features (N, D)."""
    feats = feats.double()
    return feats.mean(0), torch.cov(feats.T)


def frechet_from_moments(mu_a: torch.Tensor, cov_a: torch.Tensor, mu_b: torch.Tensor,
                         cov_b: torch.Tensor) -> float:
    """||mu_a - mu_b||^2 + Tr(A + B - 2 (A B)^(1/2)).

    Tr (A B)^(1/2) is taken as the sum of square roots of the eigenvalues of A^(1/2) B A^(1/2), which is
    symmetric PSD, so a symmetric eigensolver suffices (no scipy, works on any torch device)."""
    vals, vecs = torch.linalg.eigh(cov_a)
    root_a = (vecs * vals.clamp(min=0).sqrt()) @ vecs.T
    inner = root_a @ cov_b @ root_a
    cross = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp(min=0).sqrt().sum()
    value = (mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * cross
    return float(value)


def frechet_distance(feats_a: torch.Tensor, feats_b: torch.Tensor) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets."""
    return frechet_from_moments(*moments(feats_a), *moments(feats_b))


class Evaluator:
    """Holds the feature network and the test split's moments; scores batches of generated images."""

    def __init__(self, dataset: Dataset, device: torch.device | str, cache: str | os.PathLike | None = None):
        self.net, self.classifier_accuracy = load_classifier(dataset, device, cache)
        self.reference = moments(features(self.net, dataset.test.images.to(device)))

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """``fd``: Fréchet distance to the test split; ``accuracy``: classifier agrees with the labels."""
        images = images.clamp(-1, 1)
        return {
            "fd": frechet_from_moments(*moments(features(self.net, images)), *self.reference),
            "accuracy": accuracy(self.net, images, labels),
            "classifier_test_accuracy": self.classifier_accuracy,
        }

