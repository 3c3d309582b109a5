"""Flax (linen) models for the training runs: MLP, CNN, AlexNet, ResNet-20/50/101, VGG-16/19,
SENet-18, DenseNet.

The CIFAR models (``NORMALIZED``) take ``norm=``:

- ``"group"`` (the default, what every run before ``norm`` existed used):
  GroupNorm, no batch statistics, so the data-parallel step stays a pure
  function of (params, batch) and every device normalises its own shard the
  same way whatever the device count.
- ``"batch"``: BatchNorm as the papers' PyTorch models (PyTorch's defaults:
  running averages updated with momentum 0.1, i.e. flax ``momentum=0.9``,
  ``epsilon=1e-5``; flax updates the running variance with the biased batch
  variance where PyTorch uses the unbiased one, a factor ``m / (m - 1)`` for
  ``m`` values per channel). Called with ``train=True`` inside
  ``jax.shard_map`` over ``axis_name``, the batch statistics are averaged
  over that axis (mean and mean of squares, ``lax.pmean``), so N devices
  normalise with the statistics of the whole global batch, as one device
  holding it would (synchronised BatchNorm). ``train=False`` (the default)
  normalises with the running averages (evaluation). Training applies the
  model with ``mutable=["batch_stats"]``.

Parameter names and counts do not depend on ``norm`` beyond the layer names
(``GroupNorm_i`` vs ``BatchNorm_i``): both have a scale and a bias per channel.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

__all__ = [
    "CNN",
    "MLP",
    "AlexNet",
    "MODELS",
    "NORMALIZED",
    "NORMS",
    "DenseNet",
    "DenseNet121",
    "DenseNet169",
    "ResNet20",
    "ResNet50",
    "ResNet101",
    "SENet18",
    "VGG16",
    "VGG19",
    "make_model",
]

NORMS = ("group", "batch")


def _norm(norm: str, train: bool, axis_name: str | None, groups: int) -> nn.Module:
    """The normalisation layer of a CIFAR model (created inside a compact method)."""
    if norm == "group":
        return nn.GroupNorm(num_groups=groups)
    if norm == "batch":
        # axis_name only matters with batch statistics; with running averages no
        # collective is issued, so evaluation also works outside shard_map.
        return nn.BatchNorm(
            use_running_average=not train,
            momentum=0.9,
            epsilon=1e-5,
            axis_name=axis_name if train else None,
        )
    raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")


class MLP(nn.Module):
    """Two hidden layers of ReLU units."""

    num_classes: int
    hidden: tuple[int, ...] = (256, 128)

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train  # no layer behaves differently in training
        x = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(self.num_classes)(x)


class CNN(nn.Module):
    """Two 3x3 conv layers, global average pooling, one dense layer."""

    num_classes: int
    features: tuple[int, ...] = (32, 64)

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        for width in self.features:
            x = nn.relu(nn.Conv(width, (3, 3))(x))
        x = jnp.mean(x, axis=(1, 2))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(self.num_classes)(x)


class AlexNet(nn.Module):
    """CIFAR AlexNet: five conv layers, one dense classifier (2.47M parameters, 10 classes).

    The CIFAR variant of the ldte_bs paper's era, bearpaw/pytorch-classification's
    ``models/cifar/alexnet.py`` (Wei Yang): AlexNet's 64-192-384-256-256
    convolutions (11x11 stride 4 padding 5, 5x5, 3x3 x3) with biases and
    ReLU, 2x2 max-pools after the first, second and fifth, and the three dense
    layers replaced by one ``256 -> num_classes`` (a 32x32 image is 1x1 after
    the last pool). No normalisation layers, as that file.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        del train
        x = nn.relu(nn.Conv(64, (11, 11), strides=4, padding=5)(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(192, (5, 5), padding=2)(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        for width in (384, 256, 256):
            x = nn.relu(nn.Conv(width, (3, 3), padding=1)(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.num_classes)(x)


class _Block(nn.Module):
    features: int
    strides: int
    norm: str
    axis_name: str | None

    @nn.compact
    def __call__(self, x, train: bool):
        def norm():
            return _norm(self.norm, train, self.axis_name, min(8, self.features))

        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet20(nn.Module):
    """CIFAR ResNet-20 (He et al. 2016: 3 stages x 3 basic blocks, 16/32/64 filters).

    ``widths`` and ``blocks_per_stage`` shrink it for tests and quick CPU runs
    (the defaults are ResNet-20: 0.27M parameters); the shortcut of a block
    that changes the shape is a 1x1 convolution with its own norm (He et
    al.'s option B).
    """

    num_classes: int
    blocks_per_stage: int = 3
    widths: tuple[int, int, int] = (16, 32, 64)
    norm: str = "group"
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        _check_norm(self.norm)
        x = nn.Conv(self.widths[0], (3, 3), use_bias=False)(x)
        x = nn.relu(_norm(self.norm, train, self.axis_name, min(8, self.widths[0]))(x))
        for stage, width in enumerate(self.widths):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _Block(width, strides, self.norm, self.axis_name)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class _Bottleneck(nn.Module):
    features: int  # inner width; the block outputs 4 x features
    strides: int
    norm: str
    axis_name: str | None

    @nn.compact
    def __call__(self, x, train: bool):
        def norm():
            return _norm(self.norm, train, self.axis_name, 32)

        out = 4 * self.features
        y = nn.Conv(self.features, (1, 1), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(y)
        y = nn.relu(norm()(y))
        y = nn.Conv(out, (1, 1), use_bias=False)(y)
        y = norm()(y)
        if x.shape != y.shape:
            x = nn.Conv(out, (1, 1), strides=self.strides, use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet50(nn.Module):
    """ResNet-50 on CIFAR (bottlenecks 3/4/6/3, 64..512 x 4 filters).

    CIFAR stem (one 3x3 conv, no max-pool), as kuangliu/pytorch-cifar's
    ``ResNet50`` that the ldte_bs paper trains on CIFAR-100: 23.5M parameters
    with 10 classes (the paper's 89.72 MB), the gradient size the papers'
    ResNet-50 experiments exchange.
    """

    num_classes: int
    stage_sizes: tuple[int, ...] = (3, 4, 6, 3)
    norm: str = "group"
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        _check_norm(self.norm)
        x = nn.Conv(64, (3, 3), use_bias=False)(x)
        x = nn.relu(_norm(self.norm, train, self.axis_name, 32)(x))
        stages = zip((64, 128, 256, 512), self.stage_sizes, strict=True)
        for stage, (width, blocks) in enumerate(stages):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _Bottleneck(width, strides, self.norm, self.axis_name)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class ResNet101(ResNet50):
    """ResNet-101 on CIFAR (bottlenecks 3/4/23/3), kuangliu/pytorch-cifar's ``ResNet101``.

    42.5M parameters with 10 classes (the ldte_bs paper's 162.17 MB, Table 2).
    """

    stage_sizes: tuple[int, ...] = (3, 4, 23, 3)


class VGG16(nn.Module):
    """CIFAR VGG-16 (13 3x3 conv layers in 5 stages, 64..512 filters, one classifier).

    The CIFAR variant the DLGS and LDTE-BS papers train (Simonyan and
    Zisserman's configuration D with a single dense layer after the last
    pooling, 14.7M parameters with 10 classes), a norm after each
    convolution (whose shift replaces the convolution's bias).
    """

    num_classes: int
    stages: tuple[tuple[int, int], ...] = ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3))
    norm: str = "group"
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        _check_norm(self.norm)
        for width, convs in self.stages:
            for _ in range(convs):
                x = nn.Conv(width, (3, 3), use_bias=False)(x)
                x = nn.relu(_norm(self.norm, train, self.axis_name, min(32, width))(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(self.num_classes)(x)


class VGG19(VGG16):
    """CIFAR VGG-19 (16 3x3 conv layers in 5 stages), kuangliu/pytorch-cifar's ``VGG('VGG19')``.

    Configuration E with one dense classifier: 20.04M parameters with 10
    classes and BatchNorm (ours: 20.04M less the 5,504 conv biases, replaced
    by the norm's shift as in :class:`VGG16`).
    """

    stages: tuple[tuple[int, int], ...] = ((64, 2), (128, 2), (256, 4), (512, 4), (512, 4))


class _SEPreActBlock(nn.Module):
    """kuangliu/pytorch-cifar's ``senet.PreActBlock``: pre-activation block, squeeze-excite."""

    features: int
    strides: int
    norm: str
    axis_name: str | None

    @nn.compact
    def __call__(self, x, train: bool):
        def norm_relu(y):
            return nn.relu(_norm(self.norm, train, self.axis_name, min(32, y.shape[-1]))(y))

        out = norm_relu(x)
        shortcut = x
        if self.strides != 1 or x.shape[-1] != self.features:
            shortcut = nn.Conv(self.features, (1, 1), strides=self.strides, use_bias=False)(out)
        out = nn.Conv(self.features, (3, 3), strides=self.strides, use_bias=False)(out)
        out = nn.Conv(self.features, (3, 3), use_bias=False)(norm_relu(out))
        # Squeeze (global average) and excite: two 1x1 convs with biases on the
        # pooled vector (PyTorch's Conv2d(planes, planes // 16, 1) and back).
        w = jnp.mean(out, axis=(1, 2), keepdims=True)
        w = nn.relu(nn.Conv(self.features // 16, (1, 1))(w))
        w = nn.sigmoid(nn.Conv(self.features, (1, 1))(w))
        return out * w + shortcut


class SENet18(nn.Module):
    """CIFAR SENet-18, kuangliu/pytorch-cifar's ``SENet18``: 11.26M parameters, 10 classes.

    A 3x3 stem of 64 filters with norm and ReLU, four stages of two
    pre-activation basic blocks with squeeze-and-excitation (reduction 16),
    64/128/256/512 filters, strides 1/2/2/2, a 1x1 convolution on the
    pre-activated input where a block changes the shape; then global average
    pooling (no final norm, as that file) and one dense classifier.
    """

    num_classes: int
    blocks_per_stage: int = 2
    norm: str = "group"
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        _check_norm(self.norm)
        x = nn.Conv(64, (3, 3), use_bias=False)(x)
        x = nn.relu(_norm(self.norm, train, self.axis_name, 32)(x))
        for stage, width in enumerate((64, 128, 256, 512)):
            for block in range(self.blocks_per_stage):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _SEPreActBlock(width, strides, self.norm, self.axis_name)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class DenseNet(nn.Module):
    """CIFAR DenseNet-BC (kuangliu/pytorch-cifar's ``DenseNet``), pre-activation layers.

    A 3x3 stem of ``2 * growth`` filters; dense blocks of
    norm-ReLU-1x1 conv (``4 * growth``)-norm-ReLU-3x3 conv (``growth``)
    layers, each output concatenated to its input; transitions
    norm-ReLU-1x1 conv (``floor(reduction * channels)``)-2x2 average pool
    between blocks; a final norm-ReLU, global average pooling and a dense
    classifier. Convolutions have no bias.
    """

    num_classes: int
    block_sizes: tuple[int, ...] = (6, 12, 24, 16)
    growth: int = 32
    reduction: float = 0.5
    norm: str = "group"
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        _check_norm(self.norm)

        def norm_relu(y):
            groups = math.gcd(32, y.shape[-1])
            return nn.relu(_norm(self.norm, train, self.axis_name, groups)(y))

        x = nn.Conv(2 * self.growth, (3, 3), use_bias=False)(x)
        for i, layers in enumerate(self.block_sizes):
            for _ in range(layers):
                y = nn.Conv(4 * self.growth, (1, 1), use_bias=False)(norm_relu(x))
                y = nn.Conv(self.growth, (3, 3), use_bias=False)(norm_relu(y))
                x = jnp.concatenate([y, x], axis=-1)  # PyTorch's torch.cat([out, x], 1)
            if i < len(self.block_sizes) - 1:
                out = int(math.floor(x.shape[-1] * self.reduction))
                x = nn.Conv(out, (1, 1), use_bias=False)(norm_relu(x))
                x = nn.avg_pool(x, (2, 2), strides=(2, 2))
        x = jnp.mean(norm_relu(x), axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class DenseNet121(DenseNet):
    """DenseNet-121 on CIFAR (blocks 6/12/24/16, growth 32): 6.96M parameters, 10 classes."""

    block_sizes: tuple[int, ...] = (6, 12, 24, 16)


class DenseNet169(DenseNet):
    """DenseNet-169 on CIFAR (blocks 6/12/32/32, growth 32): 12.5M parameters, 10 classes."""

    block_sizes: tuple[int, ...] = (6, 12, 32, 32)


MODELS = {
    "mlp": MLP,
    "cnn": CNN,
    "alexnet": AlexNet,
    "resnet20": ResNet20,
    "vgg16": VGG16,
    "vgg19": VGG19,
    "senet18": SENet18,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "densenet121": DenseNet121,
    "densenet169": DenseNet169,
}
# The models with normalisation layers (the ones that take norm= and axis_name=).
NORMALIZED = (
    "resnet20",
    "vgg16",
    "vgg19",
    "senet18",
    "resnet50",
    "resnet101",
    "densenet121",
    "densenet169",
)


def make_model(
    name: str, num_classes: int, *, norm: str = "group", axis_name: str | None = None
) -> nn.Module:
    """Builds a model by name (a key of ``MODELS``).

    Args:
      name: ``mlp``, ``cnn``, ``alexnet``, ``resnet20``, ``vgg16``,
        ``vgg19``, ``senet18``, ``resnet50``, ``resnet101``, ``densenet121`` or
        ``densenet169``.
      num_classes: size of the classifier.
      norm: ``"group"`` or ``"batch"`` (models of ``NORMALIZED`` only; the
        others have no normalisation and take only ``"group"``, the default).
      axis_name: the mesh axis BatchNorm averages its batch statistics over
        when applied with ``train=True`` inside ``shard_map`` (``norm="batch"``).

    Raises:
      ValueError: unknown ``name`` or ``norm``, or ``norm="batch"`` for a model
        without normalisation layers.

    Example:
      >>> import jax, numpy as np
      >>> from experiments.models import make_model
      >>> model = make_model("resnet20", 10, norm="batch")
      >>> variables = model.init(jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
      >>> sorted(variables)
      ['batch_stats', 'params']
      >>> model.apply(variables, np.zeros((2, 32, 32, 3), np.float32)).shape
      (2, 10)
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {sorted(MODELS)}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    if name not in NORMALIZED:
        if norm != "group":
            raise ValueError(
                f"norm={norm!r}: model {name!r} has no normalisation layers; norm='batch' "
                f"needs one of {', '.join(NORMALIZED)}"
            )
        return MODELS[name](num_classes=num_classes)
    return MODELS[name](num_classes=num_classes, norm=norm, axis_name=axis_name)
