"""Datasets for the training runs: digits (embedded), CIFAR-10/100 archives, synthetic.

Every loader returns a :class:`Dataset` of NHWC float32 images scaled to about
[0, 1] (CIFAR: per-channel standardised) and int32 labels. Batches come from
:func:`epoch_batches`, whose order depends only on ``(seed, epoch)`` (and the
sampling mode and device count, :mod:`jaxcomp.sampling`) so that a resumed run
sees exactly the batches an uninterrupted one would. :func:`augment` is the
standard CIFAR augmentation (random crop of the image padded by 4 pixels,
random horizontal flip), a function of its seed only, so it resumes the same.
"""

from __future__ import annotations

import dataclasses
import lzma
import os
import pickle
import tarfile
import urllib.request
import zlib

import numpy as np

from jaxcomp import sampling as jaxcomp_sampling

__all__ = [
    "CIFAR_URLS",
    "DATASET_SPECS",
    "Dataset",
    "augment",
    "augment_seed",
    "dataset_path",
    "epoch_batches",
    "load_cifar",
    "load_dataset",
    "load_digits",
    "load_synthetic",
    "missing_data_message",
    "steps_per_epoch",
]

CIFAR_URLS = {
    "cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
    "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
}

# What load_dataset(name) returns, known without reading it: (training examples,
# image shape, classes). CIFAR's size is the standard archives' (a directory of
# one's own may hold fewer examples). Validation reads these, so a run is checked
# before any data is loaded.
DATASET_SPECS = {
    "digits": (1438, (8, 8, 1), 10),  # 1797 images, a fifth of them for testing
    "synthetic": (2048, (8, 8, 1), 10),  # load_synthetic's defaults
    # The same teacher task on CIFAR-shaped images: the CIFAR models without CIFAR.
    "synthetic_cifar": (2048, (32, 32, 3), 10),
    "cifar10": (50000, (32, 32, 3), 10),
    "cifar100": (50000, (32, 32, 3), 100),
}

# Per-channel statistics of the CIFAR-10 training set (the usual constants).
_CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32)
_CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], np.float32)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """An in-memory image classification dataset.

    Attributes:
      train_x: float32 ``(N, H, W, C)``.
      train_y: int32 ``(N,)``.
      test_x: float32 ``(M, H, W, C)``.
      test_y: int32 ``(M,)``.
      num_classes: number of labels.
      pad_value: what a black (raw 0) pixel is after the loader's scaling,
        per channel or a scalar: the fill of :func:`augment`'s padding (CIFAR:
        ``-mean / std``, as PyTorch pads the raw image before normalising).
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    pad_value: np.ndarray | float = 0.0


def load_digits(test_fraction: float = 0.2) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images), no network needed.

    The train/test split is a fixed permutation (seed 0), independent of the
    training seed, so runs with different seeds are evaluated on the same
    test images.
    """
    from sklearn.datasets import load_digits as _load  # noqa: PLC0415 (optional heavy import)

    raw = _load()
    x = (raw.images.astype(np.float32) / 16.0)[..., None]
    y = raw.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return Dataset(x[train], y[train], x[test], y[test], 10)


def load_synthetic(
    num_train: int = 2048,
    num_test: int = 512,
    shape: tuple[int, ...] = (8, 8, 1),
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """A learnable synthetic task: labels from a fixed random linear teacher."""
    rng = np.random.default_rng(seed)
    dim = int(np.prod(shape))
    teacher = rng.normal(size=(dim, num_classes)).astype(np.float32)
    x = rng.normal(size=(num_train + num_test, dim)).astype(np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    x = x.reshape(-1, *shape)
    return Dataset(x[:num_train], y[:num_train], x[num_train:], y[num_train:], num_classes)


def _read_pickle(data: bytes) -> dict:
    return pickle.loads(data, encoding="bytes")


def _cause(e: Exception) -> str:
    """``e`` as one line (tarfile's errors list a line per method tried)."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _decode(batch: dict, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(batch, dict):
        raise ValueError(f"not a CIFAR batch: a pickled {type(batch).__name__}, not a dict")
    if b"data" not in batch or label_key not in batch:
        raise ValueError(f"not a CIFAR batch: keys {sorted(batch)} lack b'data'/{label_key!r}")
    data = np.asarray(batch[b"data"], np.uint8)
    if data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"CIFAR b'data' must be (N, 3072) uint8, got {data.shape}")
    # Rows are channel-major (1024 R, 1024 G, 1024 B) 32x32 planes.
    x = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    y = np.asarray(batch[label_key], np.int32)
    if len(y) != len(x):
        raise ValueError(f"CIFAR batch has {len(x)} images but {len(y)} labels")
    bad = (y < 0) | (y >= num_classes)
    if bad.any():  # a label off the range trains on NaN (too large) or a wrong class
        raise ValueError(
            f"CIFAR labels must be in [0, {num_classes}), got {sorted(set(y[bad].tolist()))[:5]}"
        )
    return x, y


def load_cifar(name: str, path: str, download: bool = False) -> Dataset:
    """Reads CIFAR-10/100 in the standard python-pickle format.

    Args:
      name: ``"cifar10"`` (``data_batch_1..5``, ``test_batch``, ``b'labels'``)
        or ``"cifar100"`` (``train``, ``test``, ``b'fine_labels'``).
      path: the extracted directory (containing the batch files, directly or
        in the archive's single top-level folder) or the ``.tar.gz`` archive.
      download: fetch the archive from :data:`CIFAR_URLS` to ``path`` when it
        does not exist (never done unless asked).

    Returns:
      The dataset, images standardised per channel.

    Raises:
      FileNotFoundError: ``path`` is missing and ``download`` is false.
      ValueError: unknown name, an archive that cannot be read (garbage,
        truncated), missing or malformed batches; the message is one line.
    """
    if name == "cifar10":
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        test_files, label_key, num_classes = ["test_batch"], b"labels", 10
    elif name == "cifar100":
        train_files, test_files, label_key, num_classes = ["train"], ["test"], b"fine_labels", 100
    else:
        raise ValueError(f"unknown CIFAR dataset {name!r}; expected 'cifar10' or 'cifar100'")
    if not os.path.exists(path):
        if not download:
            raise FileNotFoundError(missing_data_message(name, path))
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        urllib.request.urlretrieve(CIFAR_URLS[name], path)  # noqa: S310 (fixed https URL)

    wanted = set(train_files + test_files)
    blobs: dict[str, bytes] = {}
    try:
        if os.path.isdir(path):
            for root, _, files in os.walk(path):
                for f in files:
                    if f in wanted and f not in blobs:
                        with open(os.path.join(root, f), "rb") as fh:
                            blobs[f] = fh.read()
        else:
            with tarfile.open(path, "r:*") as tar:
                for member in tar.getmembers():
                    base = os.path.basename(member.name)
                    if member.isfile() and base in wanted and base not in blobs:
                        blobs[base] = tar.extractfile(member).read()
    except (OSError, EOFError, tarfile.TarError, zlib.error, lzma.LZMAError) as e:
        # A garbage or truncated archive fails in the decompressor or the tar reader.
        raise ValueError(
            f"{path} is not a readable {name} archive or directory ({_cause(e)})"
        ) from None
    missing = sorted(wanted - set(blobs))
    if missing:
        raise ValueError(f"{path} lacks CIFAR batch files {missing}")

    def unpickle(f):
        try:
            return _read_pickle(blobs[f])
        except Exception as e:  # noqa: BLE001 (unpickling garbage can raise almost anything)
            raise ValueError(f"{path}: {f} is not a pickled CIFAR batch ({_cause(e)})") from None

    def stack(files):
        parts = [_decode(unpickle(f), label_key, num_classes) for f in files]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def norm(x):
        return ((x.astype(np.float32) / 255.0) - _CIFAR_MEAN) / _CIFAR_STD

    (trx, try_), (tex, tey) = stack(train_files), stack(test_files)
    black = (0.0 - _CIFAR_MEAN) / _CIFAR_STD  # a raw 0 pixel, standardised
    return Dataset(norm(trx), try_, norm(tex), tey, num_classes, pad_value=black)


def missing_data_message(name: str, path: str, cli: bool = False) -> str:
    """What to do when the ``name`` archive/directory ``path`` does not exist.

    Args:
      name: ``"cifar10"`` or ``"cifar100"``.
      path: where it was looked for.
      cli: name the command-line flags (``--data_dir``, ``--download``)
        instead of the Python arguments.
    """
    data_dir, download = ("--data_dir", "--download") if cli else ("data_dir=", "download=True")
    return (
        f"{name} data not found at {path}: pass {data_dir} pointing at the extracted "
        f"directory or the {os.path.basename(CIFAR_URLS[name])} archive, or {download} to "
        f"fetch it from {CIFAR_URLS[name]} to that path"
    )


def dataset_path(name: str, data_dir: str | None = None) -> str | None:
    """Where :func:`load_dataset` reads ``name`` from (None: built in, no file).

    For CIFAR, ``data_dir`` or ``~/.cache/jaxcomp/<name>-python.tar.gz``.
    """
    if name not in CIFAR_URLS:
        return None
    archive = os.path.basename(CIFAR_URLS[name])
    return data_dir or os.path.expanduser(f"~/.cache/jaxcomp/{archive}")


def load_dataset(name: str, data_dir: str | None = None, download: bool = False) -> Dataset:
    """Loads ``digits``, ``synthetic``, ``synthetic_cifar``, ``cifar10`` or ``cifar100``.

    For CIFAR, ``data_dir`` is the directory or archive (default
    ``~/.cache/jaxcomp/<name>-python.tar.gz``).
    """
    if name == "digits":
        return load_digits()
    if name == "synthetic":
        return load_synthetic()
    if name == "synthetic_cifar":
        return load_synthetic(shape=DATASET_SPECS[name][1])
    if name in CIFAR_URLS:
        return load_cifar(name, dataset_path(name, data_dir), download=download)
    raise ValueError(
        f"unknown dataset {name!r}; expected digits, synthetic, synthetic_cifar, cifar10, cifar100"
    )


def steps_per_epoch(num_examples: int, batch_size: int) -> int:
    """Full batches per epoch (the remainder is dropped to keep shapes static)."""
    return num_examples // batch_size


def epoch_batches(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int,
    epoch: int,
    *,
    sampling: str = "global",
    num_devices: int = 1,
):
    """Yields the full global batches of one epoch, drawn by ``sampling``.

    The order is a function of ``(seed, epoch)`` only: the data-order state
    a checkpoint needs is the epoch number. Each batch is laid out as
    ``jaxcomp.distributed.shard_batch`` splits it: device ``d`` gets rows
    ``[d * b, (d + 1) * b)``, ``b = batch_size // num_devices``, which are its
    draws of :func:`jaxcomp.sampling.epoch_indices` (``"global"``: one
    permutation of the training set per epoch, the same batches for any
    ``num_devices``; ``"replacement"``: each device draws i.i.d. from the
    whole set; ``"local"``: each device shuffles its own fixed shard).

    Args:
      x: training inputs.
      y: training labels.
      batch_size: global batch size.
      seed: the run's seed.
      epoch: 0-based epoch.
      sampling: a mode of ``jaxcomp.sampling.SAMPLE_MODES``.
      num_devices: devices sharing each batch (divides ``batch_size``).
    """
    if len(y) < batch_size:
        return  # no full batch (the caller reports it)
    plan = jaxcomp_sampling.epoch_indices(
        sampling, len(y), batch_size, num_devices, seed=seed, epoch=epoch
    )
    for idx in plan.reshape(len(plan), -1):
        yield x[idx], y[idx]


def augment_seed(seed: int, epoch: int, step: int) -> np.random.SeedSequence:
    """The seed of :func:`augment` for one training step (a function of the three only)."""
    for name, v in (("seed", seed), ("epoch", epoch), ("step", step)):
        if int(v) != v or v < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
    # A fixed tag keeps these streams apart from other uses of (seed, epoch).
    return np.random.SeedSequence([int(seed), int(epoch), int(step), 0xA06])


def augment(
    x: np.ndarray,
    seed,
    *,
    padding: int = 4,
    flip: bool = True,
    fill: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Standard CIFAR augmentation of a batch: random crop after padding, random flip.

    Each image is padded by ``padding`` pixels of ``fill`` on every side,
    cropped back to its size at an offset drawn uniformly from
    ``[0, 2 * padding]`` in each direction, and mirrored left-right with
    probability 1/2 (torchvision's ``RandomCrop(32, padding=4)`` then
    ``RandomHorizontalFlip()``). Draws: the ``(row, column)`` offsets of all
    images, then their flips, from ``numpy.random.default_rng(seed)``.

    Args:
      x: ``(B, H, W, C)`` images.
      seed: anything ``numpy.random.default_rng`` takes (an int, a
        ``SeedSequence`` such as :func:`augment_seed`'s).
      padding: pixels of padding, ``>= 0`` (0: no crop).
      flip: whether to flip.
      fill: the padding's value, a scalar or one per channel (CIFAR: the
        dataset's ``pad_value``, black).

    Returns:
      A new float array of ``x``'s shape and dtype.

    Raises:
      ValueError: ``x`` not 4-D, or ``padding`` negative.

    Example:
      >>> import numpy as np
      >>> from experiments.data import augment
      >>> x = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4, 1)
      >>> out = augment(x, 0, padding=1)
      >>> out.shape
      (2, 4, 4, 1)
      >>> bool(np.array_equal(augment(x, 0, padding=1), out))  # same seed, same batch
      True
    """
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"augment needs (batch, height, width, channels) images, got {x.shape}")
    if isinstance(padding, bool) or int(padding) != padding or padding < 0:
        raise ValueError(f"padding must be an integer >= 0, got {padding!r}")
    b, h, w, c = x.shape
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, 2 * padding + 1, size=(b, 2))
    flips = rng.random(b) < 0.5 if flip else np.zeros(b, bool)
    padded = np.empty((b, h + 2 * padding, w + 2 * padding, c), x.dtype)
    padded[...] = np.asarray(fill, x.dtype)
    padded[:, padding : padding + h, padding : padding + w] = x
    rows = offsets[:, :1] + np.arange(h)  # (B, H)
    cols = np.arange(w)
    cols = offsets[:, 1:] + np.where(flips[:, None], cols[::-1], cols)  # (B, W)
    return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
