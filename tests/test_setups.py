"""Tests of the papers' training setups: synchronised BatchNorm, augmentation, schedules."""

import dataclasses
import functools
import io
import pickle
import tarfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from experiments import data as data_lib
from experiments import models, setups, train

AXIS = "data"
# ResNet-20's layers shrunk to one stage of one block (stem, two convs, three
# BatchNorms), cheap to compile.
_NARROW = functools.partial(models.ResNet20, widths=(4,), blocks_per_stage=1)


class _BN(nn.Module):
    """models' BatchNorm layer alone (what the CIFAR models put after each conv)."""

    @nn.compact
    def __call__(self, x, train=False):
        return models._norm("batch", train, AXIS, 1)(x)


def _bn_on_mesh(n):
    mesh = jax.make_mesh((n,), (AXIS,), devices=jax.devices()[:n])
    bn = _BN()

    def f(variables, x):
        y, new = bn.apply(variables, x, train=True, mutable=["batch_stats"])
        return y, new

    return mesh, jax.jit(
        jax.shard_map(
            f, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=(P(AXIS), P()), check_vma=False
        )
    )


def test_batchnorm_statistics_over_devices_are_the_whole_batch():
    # Each device's shard has its own offset, so per-shard statistics would differ.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 3, 3, 5)).astype(np.float32)
    x += np.repeat(np.arange(8, dtype=np.float32), 2)[:, None, None, None] * 3.0
    variables = _BN().init(jax.random.key(0), x[:1])
    mean, var = x.mean(axis=(0, 1, 2)), x.var(axis=(0, 1, 2))
    for n in (8, 2):
        mesh, f = _bn_on_mesh(n)
        y, new = f(variables, jaxcomp.distributed.shard_batch(x, mesh))
        stats = new["batch_stats"]["BatchNorm_0"]
        # Running averages after one step from (0, 1), PyTorch's momentum 0.1.
        np.testing.assert_allclose(stats["mean"], 0.1 * mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(stats["var"], 0.9 + 0.1 * var, rtol=1e-5)
        np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-4)


def _brute_force_augment(x, seed, padding, fill):
    rng = np.random.default_rng(seed)
    offsets = rng.integers(0, 2 * padding + 1, size=(len(x), 2))
    flips = rng.random(len(x)) < 0.5
    out = np.empty_like(x)
    h, w, c = x.shape[1:]
    for i in range(len(x)):
        padded = np.stack(
            [np.pad(x[i, ..., k], padding, constant_values=fill[k]) for k in range(c)], axis=-1
        )
        crop = padded[offsets[i, 0] : offsets[i, 0] + h, offsets[i, 1] : offsets[i, 1] + w]
        out[i] = crop[:, ::-1] if flips[i] else crop
    return out, offsets, flips


def test_augment_matches_brute_force_crop_and_flip():
    x = np.random.default_rng(2).normal(size=(64, 32, 32, 3)).astype(np.float32)
    fill = (0.0 - data_lib._CIFAR_MEAN) / data_lib._CIFAR_STD
    seed = data_lib.augment_seed(3, 1, 7)
    out = data_lib.augment(x, seed, fill=fill)
    want, offsets, flips = _brute_force_augment(x, data_lib.augment_seed(3, 1, 7), 4, fill)
    np.testing.assert_array_equal(out, want)
    # Every offset and both flips occur: the draws cover the 9 x 9 crops.
    assert set(offsets.ravel()) == set(range(9)) and 0 < flips.sum() < 64
    assert not np.array_equal(out, data_lib.augment(x, data_lib.augment_seed(3, 1, 8), fill=fill))
    np.testing.assert_array_equal(data_lib.augment(x, 0, padding=0, flip=False), x)
    with pytest.raises(ValueError, match="padding"):
        data_lib.augment(x, 0, padding=-1)
    with pytest.raises(ValueError, match="batch, height"):
        data_lib.augment(x[0], 0)


def test_step_schedule_with_milestones_by_hand():
    config = dataclasses.replace(
        train.TrainConfig(), schedule="step", lr=0.2, lr_milestones=(2, 5), lr_decay=0.5, epochs=8
    )
    spe = 3
    lr = train.learning_rate(config, spe, 8 * spe)
    for step in range(8 * spe):
        epoch = step // spe
        want = 0.2 * 0.5 ** ((epoch >= 2) + (epoch >= 5))
        np.testing.assert_allclose(float(lr(step)), want, rtol=1e-6)
    for bad, match in [
        (dict(lr_milestones=(5, 2)), "strictly increasing"),
        (dict(lr_milestones=(2, 8)), r"\[1, epochs=8\)"),
        (dict(lr_milestones=(0,)), "strictly increasing"),
        (dict(schedule="cosine"), "needs schedule='step'"),
        (dict(lr_decay=0.0), r"lr_decay must be in \(0, 1\]"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
        (dict(norm="layer"), "norm"),
    ]:
        with pytest.raises(ValueError, match=match):
            train.validate_config(dataclasses.replace(config, **bad))
    with pytest.raises(ValueError, match="normalisation layers"):
        train.validate_config(dataclasses.replace(config, norm="batch", model="mlp"))
    coded = dict(compressor="dense", exchange="coded", redundancy=1, model="resnet20")
    with pytest.raises(ValueError, match="norm='batch' is not supported"):
        train.validate_config(dataclasses.replace(config, norm="batch", **coded))


def test_weight_decay_is_added_to_the_gradient_before_the_exchange():
    mesh = jax.make_mesh((1,), (AXIS,), devices=jax.devices()[:1])
    config = dataclasses.replace(
        train.TrainConfig(), compressor="dense", momentum=0.0, lr=0.5, weight_decay=0.1
    )
    tx, _ = train.build_optimizer(config, 1, 1)
    w = {"w": jnp.array([1.0, -2.0, 3.0])}
    g = {"w": jnp.array([0.5, 0.5, -1.0])}

    def f(g, w):
        updates, _ = tx.update(g, tx.init(w), w)
        return updates

    updates = jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)(g, w)
    np.testing.assert_allclose(updates["w"], -0.5 * (np.array(g["w"]) + 0.1 * np.array(w["w"])))


# The ldte_bs paper's Table 2: setup, its V column (MB = 2**20 bytes of float32
# parameters) and the width of the model's last features (the classifier's input).
_TABLE2_SIZES = [
    ("ldte_bs_table2_resnet101_cifar10", 162.17, 2048),
    ("ldte_bs_table2_densenet169_cifar10", 47.66, 1664),
    ("ldte_bs_table2_resnet50_cifar100", 89.72, 2048),
    ("ldte_bs_table2_densenet121_cifar100", 26.54, 1024),
]


@pytest.mark.parametrize(("setup", "paper_mib", "features"), _TABLE2_SIZES)
def test_model_sizes_against_the_ldte_bs_papers_table2(setup, paper_mib, features):
    # With a 10-class head every model is the paper's V. The paper lists that
    # size for the CIFAR-100 models too: their 100-class heads add
    # 90 (features + 1) parameters (ResNet-50 90.43 MiB, DenseNet-121 26.89).
    config = setups.setup_config(setup)
    classes = data_lib.DATASET_SPECS[config.dataset][2]
    x = np.zeros((1, 32, 32, 3), np.float32)

    def mib(num_classes):
        model = models.make_model(config.model, num_classes, norm="batch")
        shapes = jax.eval_shape(model.init, jax.random.key(0), x)
        assert set(shapes) == {"params", "batch_stats"}
        return 4 * sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes["params"])) / 2**20

    assert round(mib(10), 2) == paper_mib
    head = 4 * (classes - 10) * (features + 1) / 2**20
    np.testing.assert_allclose(mib(classes), paper_mib + head, atol=0.006)
    assert (round(mib(classes), 2) == paper_mib) == (classes == 10)


def _write_cifar(path, n_train=16, n_test=32):
    rng = np.random.default_rng(0)

    def batch(n):
        return {
            b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, size=n)],
        }

    files = {f"data_batch_{i}": batch(n_train) for i in range(1, 6)}
    files["test_batch"] = batch(n_test)
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            blob = pickle.dumps(content)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


@pytest.fixture(scope="module")
def cifar(tmp_path_factory):
    path = tmp_path_factory.mktemp("cifar") / "cifar-10-python.tar.gz"
    _write_cifar(path)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def narrow():
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(models.MODELS, "resnet20", _NARROW)
        yield


def _config(cifar, **kw):
    # The resnet20_cifar10 setup (BatchNorm, augmentation, step schedule, weight
    # decay), shrunk: 80 images, batch 32 (2 steps per epoch), 2 epochs.
    values = dict(
        data_dir=cifar,
        batch_size=32,
        epochs=2,
        num_devices=4,
        progress=False,
        time_split=False,
        checkpoint=True,
    )
    return setups.setup_config("resnet20_cifar10", **{**values, **kw})


@pytest.fixture(scope="module")
def straight(cifar, tmp_path_factory):
    """The shrunk setup trained for 2 epochs on 4 devices without interruption."""
    return train.train_and_evaluate(_config(cifar), str(tmp_path_factory.mktemp("straight")))


def test_batchnorm_run_resumes_with_its_statistics_and_evaluates_with_them(
    cifar, straight, tmp_path
):
    config = _config(cifar)
    assert config.norm == "batch" and config.augment and config.lr_milestones == (1,)
    train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    # time_split may change on resume; on, it runs the stateful step's variants.
    resumed = train.train_and_evaluate(dataclasses.replace(config, time_split=True), str(tmp_path))
    assert resumed["final"]["time_forward_backward"] > 0 and resumed["final"]["time_step"] > 0
    # The running averages moved from their initial (0, 1) and were restored.
    stats = straight["model_state"]["batch_stats"]
    assert not np.allclose(stats["BatchNorm_0"]["var"], 1.0)
    for a, b in zip(
        jax.tree.leaves((straight["params"], stats)),
        jax.tree.leaves((resumed["params"], resumed["model_state"]["batch_stats"])),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [r["test_accuracy"] for r in straight["records"]] == [
        r["test_accuracy"] for r in resumed["records"]
    ]
    # Evaluation normalises with the running averages: recompute it with them.
    ds = data_lib.load_cifar("cifar10", cifar)
    model = models.make_model("resnet20", 10, norm="batch")
    logits = model.apply({"params": straight["params"], "batch_stats": stats}, ds.test_x)
    acc = float(np.mean(np.argmax(logits, -1) == ds.test_y))
    assert straight["final"]["test_accuracy"] == acc
    # ... and they matter: the statistics of the test batch itself predict otherwise.
    batch_logits, _ = model.apply(
        {"params": straight["params"], "batch_stats": stats},
        ds.test_x,
        train=True,
        mutable=["batch_stats"],
    )
    assert not np.allclose(batch_logits, logits, atol=1e-3)


@pytest.mark.filterwarnings("ignore:Data has no positive values")  # 1 device sends 0 bytes
def test_batchnorm_run_on_devices_matches_one_device(cifar, straight, tmp_path):
    # Dense exchange and synchronised BatchNorm: 4 devices train as 1 device on the
    # whole global batch (the same augmented images too), so the mean of the
    # devices' gradients is the whole batch's and the statistics are its own.
    config = _config(cifar, num_devices=1, checkpoint=False, eval_examples=8)
    one = train.train_and_evaluate(config, str(tmp_path))
    ds = data_lib.load_cifar("cifar10", cifar)
    model = models.make_model("resnet20", 10, norm="batch")
    init = model.init(jax.random.key(0), ds.train_x[:1])
    # Compare what training changed (parameters moved from init, statistics from (0, 1)).
    for a, b, a0 in zip(
        jax.tree.leaves((one["params"], one["model_state"])),
        jax.tree.leaves((straight["params"], straight["model_state"])),
        jax.tree.leaves((init["params"], {"batch_stats": init["batch_stats"]})),
        strict=True,
    ):
        np.testing.assert_allclose(a - a0, b - a0, rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose(
        [r["train_loss"] for r in one["records"]],
        [r["train_loss"] for r in straight["records"]],
        rtol=1e-5,
    )
    # eval_examples: the accuracy of the first 8 test images, recomputed here.
    logits = model.apply({"params": one["params"], **one["model_state"]}, ds.test_x[:8])
    assert one["final"]["test_accuracy"] == float(np.mean(np.argmax(logits, -1) == ds.test_y[:8]))


def test_setup_flag_applies_the_setup_and_explicit_flags_override():
    from experiments import cli, main  # noqa: PLC0415

    def parse(*argv):
        return main.config_from_flags(cli.parse(main.define_flags, ["main", *argv]))

    assert parse() == train.TrainConfig()  # no --setup: the flags' defaults, as before
    base = parse("--setup=ldte_bs_table2_resnet50_cifar100")
    assert base == setups.setup_config("ldte_bs_table2_resnet50_cifar100")
    assert (base.model, base.dataset, base.batch_size, base.epochs) == (
        "resnet50",
        "cifar100",
        128,
        150,
    )
    assert (base.compressor, base.compressor_kwargs, base.warmup_epochs, base.lr_milestones) == (
        "ldte_bs",
        {"ratio": 1e-3},
        4,
        (75, 112),
    )
    over = parse(
        "--setup=ldte_bs_table2_resnet50_cifar100",
        "--compressor=qsgd",
        "--epochs=10",
        "--batch_size=64",
        "--norm=group",
    )
    assert (over.compressor, over.epochs, over.batch_size, over.norm) == ("qsgd", 10, 64, "group")
    # The sparsifier's settings are dropped for qsgd; the milestones keep their fractions.
    assert (over.compressor_kwargs, over.warmup_epochs, over.momentum_correction) == ({}, 0, None)
    assert over.lr_milestones == (5, 7) and over.weight_decay == 5e-4
    assert parse("--setup=dlgs_vgg16_cifar10", "--lr_milestones=3,4").lr_milestones == (3, 4)
    # A kwarg flag (shorthand or --compressor_kwargs) overrides the setup's key by key.
    for flag in ("--ratio=0.01", "--compressor_kwargs=ratio=0.01"):
        dlgs = parse("--setup=dlgs_vgg16_cifar10", flag)
        assert dlgs.compressor_kwargs == {
            "ratio": 0.01, "granularity": "layer", "reuse_period": 5, "capacity_factor": "uncapped",
        }  # fmt: skip
        assert dlgs.merge == "greedy"  # the paper's Algorithm 2
    # Another schedule drops the step schedule's milestones (validation named
    # --lr_milestones, a flag never passed); given explicitly they stay, refused.
    for schedule in ("cosine", "constant"):
        other = parse("--setup=resnet20_cifar10", f"--schedule={schedule}")
        expect = dataclasses.replace(
            setups.setup_config("resnet20_cifar10"),
            schedule=schedule,
            lr_milestones=train.TrainConfig().lr_milestones,
            lr_decay=train.TrainConfig().lr_decay,
        )
        assert other == expect and other.lr_milestones == ()
        train.validate_config(other)
    with pytest.raises(ValueError, match="lr_milestones"):
        train.validate_config(
            parse("--setup=resnet20_cifar10", "--schedule=cosine", "--lr_milestones=3")
        )
    for name in setups.SETUPS:  # every setup, with the compressors the notebook compares
        for compressor in ("dense", "ldte_bs", "qsgd", "powersgd"):
            train.validate_config(setups.setup_config(name, compressor=compressor))


def test_setup_fields_the_compressor_does_not_use_stay_unset():
    # DLGS's threshold reuse is a sparsifier setting; random_k picks indices
    # and has no threshold to reuse, so the setup leaves it unset for random_k.
    c = setups.setup_config("dlgs_vgg16_cifar10", compressor="random_k")
    assert setups.setup_config("dlgs_vgg16_cifar10").compressor_kwargs["reuse_period"] > 1
    assert "reuse_period" not in c.compressor_kwargs and c.compressor_kwargs["ratio"] == 0.1
    train.validate_config(c)
    given = {"reuse_period": 5}
    with pytest.raises(ValueError, match="reuse_period"):
        train.validate_config(
            setups.setup_config(
                "dlgs_vgg16_cifar10", compressor="random_k", compressor_kwargs=given
            )
        )
