"""Tests of the experiment runner: training per compressor family, data, resume, flags."""

import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile

import jax
import numpy as np
import pytest

from experiments import data as data_lib
from experiments import train

# Shrunk runs: 2 devices, 2 steps, no progress bar; one epoch each.
TINY = train.TrainConfig(
    compressor="dense",
    num_devices=2,
    dataset="synthetic",
    model="mlp",
    epochs=1,
    batch_size=16,
    max_steps_per_epoch=2,
    progress=False,
    checkpoint=False,
    lr=0.05,
)


@pytest.mark.parametrize(
    "overrides",
    [
        {"compressor": "dense"},
        # Global granularity: one selection, the quickest ldte_bs to compile.
        {"compressor": "ldte_bs", "ratio": 0.01, "warmup_epochs": 1, "granularity": "global"},
        {"compressor": "qsgd", "levels": 4, "momentum_correction": False},
        {"compressor": "onebit", "momentum_correction": False, "bucket_size": 64},
    ],
    ids=lambda o: o["compressor"],
)
def test_one_epoch_per_compressor_family(tmp_path, overrides):
    config = dataclasses.replace(TINY, **overrides)
    result = train.train_and_evaluate(config, str(tmp_path))
    (record,) = result["records"]
    assert record["epoch"] == 1
    assert np.isfinite(record["train_loss"])
    assert 0.0 <= record["test_accuracy"] <= 1.0
    assert record["bytes_per_step_per_device"] > 0
    assert record["compression_time_share"] > 0
    with open(tmp_path / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert lines == result["records"]
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    if config.compressor == "ldte_bs":
        # Warm-up epoch at DGC's 25%: density near it, far below dense.
        assert 0.0 < record["density"] <= 0.5
        assert record["message_bytes_per_step_per_device"] < 4 * result["num_params"]


def test_resume_gives_identical_parameters(tmp_path):
    config = dataclasses.replace(
        TINY,
        compressor="ldte_bs",
        ratio=0.01,
        warmup_epochs=1,
        epochs=2,
        checkpoint=True,
        schedule="cosine",
        granularity="global",
        time_compression=False,
    )
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))
    first = train.train_and_evaluate(config, str(tmp_path / "b"), stop_after_epoch=1)
    assert [r["epoch"] for r in first["records"]] == [1]
    resumed = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert resumed["records"][0] == first["records"][0]
    leaves_a = [np.asarray(x) for x in _leaves(straight["params"])]
    leaves_b = [np.asarray(x) for x in _leaves(resumed["params"])]
    assert len(leaves_a) == len(leaves_b)
    for a, b in zip(leaves_a, leaves_b, strict=True):
        assert np.array_equal(a, b)
    # The run really changed the parameters between epochs 1 and 2.
    assert not all(
        np.array_equal(a, b) for a, b in zip(_leaves(first["params"]), leaves_b, strict=True)
    )


def _leaves(tree):
    return jax.tree.leaves(tree)


def _pickled(obj) -> bytes:
    return pickle.dumps(obj, protocol=2)


def _write_tiny_cifar(path, n_train=4, n_test=3):
    rng = np.random.default_rng(0)

    def batch(n, key):
        return {
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            key: [int(v) for v in rng.integers(0, 10, size=n)],
        }

    files = {f"data_batch_{i}": batch(n_train, b"labels") for i in range(1, 6)}
    files["test_batch"] = batch(n_test, b"labels")
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            blob = _pickled(content)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    return files


def test_cifar_reader_on_written_archive(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    files = _write_tiny_cifar(archive)
    ds = data_lib.load_cifar("cifar10", str(archive))
    assert ds.train_x.shape == (20, 32, 32, 3) and ds.test_x.shape == (3, 32, 32, 3)
    assert ds.num_classes == 10 and ds.train_y.dtype == np.int32
    np.testing.assert_array_equal(ds.train_y[:4], files["data_batch_1"][b"labels"])
    # Channel-major rows: pixel (0, 1) of channel G is element 1024 + 1.
    raw = files["data_batch_1"][b"data"][0]
    expect = (raw[1025] / 255.0 - data_lib._CIFAR_MEAN[1]) / data_lib._CIFAR_STD[1]
    assert np.isclose(ds.train_x[0, 0, 1, 1], expect)
    # The extracted directory reads the same.
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "x", filter="data")
    ds2 = data_lib.load_cifar("cifar10", str(tmp_path / "x"))
    np.testing.assert_array_equal(ds.train_x, ds2.train_x)
    with pytest.raises(FileNotFoundError, match="download"):
        data_lib.load_cifar("cifar10", str(tmp_path / "missing.tar.gz"))


def test_epoch_order_is_deterministic():
    x = np.arange(10)[:, None]
    y = np.arange(10)

    def order(seed, epoch):
        return np.concatenate([b for _, b in data_lib.epoch_batches(x, y, 3, seed, epoch)])

    np.testing.assert_array_equal(order(0, 1), order(0, 1))
    assert len(order(0, 1)) == 9
    assert not np.array_equal(order(0, 0), order(0, 1))
    assert not np.array_equal(order(0, 0), order(1, 0))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"compressor": "nope"}, "unknown compressor"),
        ({"compressor": "ldte_bs", "ratio": 0.0}, "ratio"),
        ({"compressor": "ldte_bs", "ratio": 1.5}, "ratio"),
        ({"batch_size": 15}, "divisible"),
        ({"compressor": "qsgd", "momentum_correction": False}, "levels"),
        ({"compressor": "onebit"}, "momentum_correction"),
        ({"warmup_epochs": 2}, "sparsifier"),
        ({"num_devices": 64}, "devices exist"),
        ({"model": "vgg"}, "unknown model"),
        ({"dataset": "mnist"}, "unknown dataset"),
        ({"schedule": "step"}, "schedule"),
        ({"num_processes": 2}, "go together"),
    ],
)
def test_invalid_config_fails_before_training(tmp_path, overrides, message):
    config = dataclasses.replace(TINY, **overrides)
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_main_rejects_bad_flags_before_training(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for args, message in [
        (["--compressor=foo"], "compressor"),
        (["--compressor=qsgd", "--nomomentum_correction"], "levels"),
        (["--batch_size=60", "--num_devices=8"], "divisible"),
    ]:
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.main", f"--workdir={tmp_path}", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert proc.returncode != 0
        assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_every_config_field_has_a_flag():
    from experiments import main  # noqa: PLC0415 (defines absl flags on import)

    names = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert names <= set(main.FLAGS)


@pytest.mark.parametrize("name, params", [("mlp", 50826), ("cnn", 28426), ("resnet20", None)])
def test_models_build(name, params):
    from experiments import models  # noqa: PLC0415

    model = models.make_model(name, 10)
    x = np.zeros((2, 8, 8, 1), np.float32)
    variables = model.init(jax.random.key(0), x)
    assert set(variables) == {"params"}  # no batch statistics to synchronise
    assert model.apply(variables, x).shape == (2, 10)
    count = sum(v.size for v in jax.tree.leaves(variables))
    if params is not None:
        assert count == params
    else:
        # CIFAR ResNet-20 has ~0.27M parameters.
        assert 250_000 < count < 300_000


def test_main_trains_with_num_devices_flag(tmp_path):
    # Without XLA_FLAGS: --num_devices alone must create the simulated devices (a
    # plain CPU has one, and validation would reject num_devices=4).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.main",
            f"--workdir={tmp_path}",
            "--num_devices=4",
            "--compressor=top_k",
            "--ratio=0.05",
            "--dataset=synthetic",
            "--epochs=1",
            "--batch_size=16",
            "--max_steps_per_epoch=2",
            "--noprogress",
            "--nocheckpoint",
            "--notime_compression",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert record["epoch"] == 1 and record["bytes_per_step_per_device"] > 0


def test_resnet20_on_written_cifar_archive(tmp_path):
    # The paper-comparison path (CIFAR-10 + ResNet-20) end to end, shrunk.
    archive = tmp_path / "cifar-10-python.tar.gz"
    _write_tiny_cifar(archive)
    config = dataclasses.replace(
        TINY,
        dataset="cifar10",
        data_dir=str(archive),
        model="resnet20",
        max_steps_per_epoch=1,
        time_compression=False,
    )
    result = train.train_and_evaluate(config, str(tmp_path / "run"))
    assert result["num_params"] > 250_000
    assert np.isfinite(result["final"]["train_loss"])


def test_resnet50_size():
    # Shapes only (no compute): the CIFAR ResNet-50 has 23,520,842 parameters
    # (torchvision's 25,557,032 minus the 7x7 stem and the 1000-class head,
    # plus a 3x3 stem and a 10-class head; GroupNorm has BatchNorm's scale/bias).
    from experiments import models  # noqa: PLC0415

    model = models.make_model("resnet50", 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert count == 25_557_032 - 7 * 7 * 3 * 64 + 3 * 3 * 3 * 64 - 2_049_000 + 20_490
