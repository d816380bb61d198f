"""CIFAR-scale image classifiers (ResNet, VGG) on synthetic, learnable images or CIFAR-10.

Each class has a fixed random template; a sample is its class template plus Gaussian
noise, so a model can learn it and convergence is measurable. Normalisation is
GroupNorm (no batch statistics), so the loss is a pure function of params and batch.

Paper-scale configs (TopKA2A's CNN workloads, CIFAR-10): ResNet-20/ResNet-18 and
VGG-16 on 32 x 32 x 3 images, batch 128 per GPU: ``--model resnet --width 64
--blocks 2`` and ``--model vgg --width 64 --blocks 2`` approach them.

Example:
    >>> import jax
    >>> from models import vision
    >>> w = vision.workload("resnet", vision.VisionConfig())
    >>> float(w.loss(w.init(jax.random.key(0)), w.batch_at(0))) > 0
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.data import _step_rng
from models.datasets import epoch_indices, load_cifar10, normalizer
from models.workload import Workload, cross_entropy


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    image_size: int = 32  # height = width of the square images
    classes: int = 10  # number of classes
    width: int = 8  # channels of the first stage (doubled at each later stage)
    blocks: int = 1  # residual blocks (ResNet) or conv layers (VGG) per stage
    batch: int = 16  # global batch (images per step)
    noise: float = 1.0  # std of the noise added to the class templates
    data_dir: str = ""  # CIFAR-10 python batches instead of synthetic images
    seed: int = 0  # data and init seed


def _norm(channels: int) -> nn.Module:
    return nn.GroupNorm(num_groups=min(4, channels))


class ResNet(nn.Module):
    """A CIFAR ResNet: 3 stages of basic residual blocks, global pooling, linear head."""

    cfg: VisionConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg.width
        x = nn.relu(_norm(c)(nn.Conv(c, (3, 3))(x)))
        for stage in range(3):
            for block in range(self.cfg.blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                ch = c * 2**stage
                y = nn.relu(_norm(ch)(nn.Conv(ch, (3, 3), strides=stride)(x)))
                y = _norm(ch)(nn.Conv(ch, (3, 3))(y))
                if stride != 1 or x.shape[-1] != ch:
                    x = nn.Conv(ch, (1, 1), strides=stride)(x)
                x = nn.relu(x + y)
        return nn.Dense(self.cfg.classes)(jnp.mean(x, axis=(1, 2)))


class VGG(nn.Module):
    """A small VGG: 3 stages of 3x3 convs with max-pooling, then two dense layers."""

    cfg: VisionConfig

    @nn.compact
    def __call__(self, x):
        for stage in range(3):
            ch = self.cfg.width * 2**stage
            for _ in range(self.cfg.blocks):
                x = nn.relu(_norm(ch)(nn.Conv(ch, (3, 3))(x)))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(4 * self.cfg.width)(x.reshape(x.shape[0], -1)))
        return nn.Dense(self.cfg.classes)(x)


ARCHS = {"resnet": ResNet, "vgg": VGG}


def synthetic_images(cfg: VisionConfig, step: int) -> dict[str, np.ndarray]:
    """The seeded batch of ``step``: class templates plus noise."""
    s = cfg.image_size
    templates = np.random.default_rng(cfg.seed + 11).normal(size=(cfg.classes, s, s, 3))
    rng = _step_rng(cfg.seed, step, salt=5)
    labels = rng.integers(0, cfg.classes, cfg.batch).astype(np.int32)
    noise = rng.normal(size=(cfg.batch, s, s, 3)) * cfg.noise
    return {"images": (templates[labels] + noise).astype(np.float32), "labels": labels}


def cifar10_data(cfg: VisionConfig) -> tuple[Callable, Callable]:
    """``(batch_at, heldout)`` over CIFAR-10: seeded shuffles of the 50 000 training
    images each epoch; the 10 000 test images are the held-out ``test`` split."""
    if (cfg.image_size, cfg.classes) != (32, 10):
        raise ValueError("CIFAR-10 images need --image-size 32 and 10 classes")
    train, test, _ = load_cifar10(cfg.data_dir)
    norm = normalizer(train)

    def batch_at(step: int) -> dict:
        idx = epoch_indices(len(train.labels), cfg.batch, cfg.seed, step)
        return {"images": norm(train.images[idx]), "labels": train.labels[idx]}

    def heldout(split: str, max_batches: int = 0) -> list[dict]:
        if split != "test":
            return []
        b = min(cfg.batch, len(test.labels))
        starts = range(0, len(test.labels) - b + 1, b)[: max_batches or None]
        return [
            {"images": norm(test.images[s : s + b]), "labels": test.labels[s : s + b]}
            for s in starts
        ]

    return batch_at, heldout


def _synthetic_data(cfg: VisionConfig):
    return (lambda step: synthetic_images(cfg, step)), (lambda split, max_batches=0: [])


def workload(arch: str, cfg: VisionConfig) -> Workload:
    """``resnet`` or ``vgg`` as a ``Workload`` (no embedding tables)."""
    model = ARCHS[arch](cfg)
    batch_at, heldout = (cifar10_data if cfg.data_dir else _synthetic_data)(cfg)

    def init(key):
        return model.init(key, jnp.zeros((1, cfg.image_size, cfg.image_size, 3)))["params"]

    def loss(params, batch, emb=None):
        return cross_entropy(model.apply({"params": params}, batch["images"]), batch["labels"])

    def metrics(params, batch):
        logits = model.apply({"params": params}, batch["images"])
        correct = jnp.argmax(logits, axis=-1) == batch["labels"]
        return {"loss": cross_entropy(logits, batch["labels"]), "accuracy": jnp.mean(correct)}

    return Workload(
        name=arch,
        init=jax.jit(init),  # one program (eager flax init compiles every initializer)
        loss=loss,
        batch_at=batch_at,
        replicated_keys=(),
        items_per_step=cfg.batch,
        items_name="samples",
        embedding_paths=(),
        config=dataclasses.asdict(cfg),
        heldout=heldout,
        metrics=metrics,
    )
