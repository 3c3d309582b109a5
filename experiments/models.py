"""Flax (linen) models for the training runs: MLP, small CNN, ResNet-20, VGG-16, ResNet-50.

ResNet-20 uses GroupNorm instead of BatchNorm: it has no batch statistics,
so the data-parallel step stays a pure function of (params, batch) and every
device normalises its own shard the same way whatever the device count (with
BatchNorm the statistics would be per device shard and need their own
synchronisation and checkpointing).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

__all__ = ["CNN", "MLP", "MODELS", "ResNet20", "ResNet50", "VGG16", "make_model"]


class MLP(nn.Module):
    """Two hidden layers of ReLU units."""

    num_classes: int
    hidden: tuple[int, ...] = (256, 128)

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two 3x3 conv layers, global average pooling, one dense layer."""

    num_classes: int
    features: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x):
        for width in self.features:
            x = nn.relu(nn.Conv(width, (3, 3))(x))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


class _Block(nn.Module):
    features: int
    strides: int

    @nn.compact
    def __call__(self, x):
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(x)
        y = nn.relu(nn.GroupNorm(num_groups=min(8, self.features))(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = nn.GroupNorm(num_groups=min(8, self.features))(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False)(x)
            x = nn.GroupNorm(num_groups=min(8, self.features))(x)
        return nn.relu(x + y)


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016: 3 stages x 3 basic blocks, 16/32/64 filters)."""

    num_classes: int
    blocks_per_stage: int = 3

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(16, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.GroupNorm(num_groups=8)(x))
        for stage, width in enumerate((16, 32, 64)):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _Block(width, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class _Bottleneck(nn.Module):
    features: int  # inner width; the block outputs 4 x features
    strides: int

    @nn.compact
    def __call__(self, x):
        out = 4 * self.features
        y = nn.Conv(self.features, (1, 1), use_bias=False)(x)
        y = nn.relu(nn.GroupNorm(num_groups=32)(y))
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(y)
        y = nn.relu(nn.GroupNorm(num_groups=32)(y))
        y = nn.Conv(out, (1, 1), use_bias=False)(y)
        y = nn.GroupNorm(num_groups=32)(y)
        if x.shape != y.shape:
            x = nn.Conv(out, (1, 1), strides=self.strides, use_bias=False)(x)
            x = nn.GroupNorm(num_groups=32)(x)
        return nn.relu(x + y)


class ResNet50(nn.Module):
    """ResNet-50 size for benchmarks (bottlenecks 3/4/6/3, 64..512 x 4 filters).

    CIFAR stem (one 3x3 conv, no max-pool) and GroupNorm as in :class:`ResNet20`;
    23.5M parameters with 10 classes, the gradient size the papers' ResNet-50
    experiments exchange.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(64, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.GroupNorm(num_groups=32)(x))
        stages = zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)
        for stage, (width, blocks) in enumerate(stages):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _Bottleneck(width, strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class VGG16(nn.Module):
    """CIFAR VGG-16 (13 3x3 conv layers in 5 stages, 64..512 filters, one classifier).

    The CIFAR variant the DLGS and LDTE-BS papers train (Simonyan and
    Zisserman's configuration D with a single dense layer after the last
    pooling, 14.7M parameters with 10 classes), with GroupNorm after each
    convolution as in :class:`ResNet20`.
    """

    num_classes: int
    stages: tuple[tuple[int, int], ...] = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))

    @nn.compact
    def __call__(self, x):
        for width, convs in self.stages:
            for _ in range(convs):
                x = nn.Conv(width, (3, 3), use_bias=False)(x)
                x = nn.relu(nn.GroupNorm(num_groups=min(32, width))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.num_classes)(x)


MODELS = {"mlp": MLP, "cnn": CNN, "resnet20": ResNet20, "vgg16": VGG16, "resnet50": ResNet50}


def make_model(name: str, num_classes: int) -> nn.Module:
    """Builds a model by name (``mlp``, ``cnn``, ``resnet20``, ``vgg16``, ``resnet50``)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    return MODELS[name](num_classes=num_classes)
