"""Tests of the experiment runner: training per compressor family, data, resume, flags."""

import contextlib
import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tarfile

import jax
import numpy as np
import pytest
from helpers import compile_flags_without_devices, compress_on_mesh

import jaxcomp
from experiments import data as data_lib
from experiments import steps, train
from experiments import workdir as workdir_lib

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
        {
            "compressor": "ldte_bs",
            "compressor_kwargs": {"ratio": 0.01, "granularity": "global"},
            "warmup_epochs": 1,
        },
        # Quantizers with their default flags (momentum on the optimizer).
        {"compressor": "qsgd"},
        # Its compression step is slow to compile: timed by the others only.
        {"compressor": "onebit", "compressor_kwargs": {"bucket_size": 64}, "time_split": False},
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
    split_keys = [f"time_{k}" for k in train.TIME_SPLIT_FIELDS]
    if config.time_split:
        assert record["time_forward_backward"] > 0 and record["time_step"] > 0
        # The parts are the recorded medians' differences, noise clipped at 0.
        again = jaxcomp.distributed.split_step_time(
            record["time_forward_backward"],
            record["time_step_without_communication"],
            record["time_step"],
        )
        assert [record[k] for k in split_keys] == list(again)
        assert record["compression_time_share"] == record["time_compression"] / record["time_step"]
        assert (tmp_path / "time_split.png").stat().st_size > 0
    else:
        assert record["compression_time_share"] == -1.0  # not measured
        assert [record[k] for k in split_keys] == [-1.0] * len(split_keys)
        assert not (tmp_path / "time_split.png").exists()
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
        compressor_kwargs={"ratio": 0.01, "granularity": "global"},
        warmup_epochs=1,
        epochs=2,
        checkpoint=True,
        schedule="cosine",
        time_split=False,
    )
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))
    first = train.train_and_evaluate(config, str(tmp_path / "b"), stop_after_epoch=1)
    assert [r["epoch"] for r in first["records"]] == [1]
    # A field that does not change the result (RESUMABLE_FIELDS) may differ.
    resumed = train.train_and_evaluate(
        dataclasses.replace(config, progress=True), str(tmp_path / "b")
    )
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
    # Under a cosine schedule the epochs done depend on the total: no extension.
    with pytest.raises(ValueError, match="epochs=2 there, 3 now"):
        train.train_and_evaluate(dataclasses.replace(config, epochs=3), str(tmp_path / "b"))


def test_pipeline_stages_run_resume_and_time_split(tmp_path):
    """--pipeline_stages: 2 stages x 2 replicas, top-k per stage; a resumed run is the same run."""
    config = dataclasses.replace(
        TINY,
        compressor="top_k",
        compressor_kwargs={"ratio": 0.05},
        num_devices=4,
        pipeline_stages=2,
        microbatches=4,
        epochs=2,
        checkpoint=True,
        time_split=False,
    )
    straight = train.train_and_evaluate(
        dataclasses.replace(config, time_split=True), str(tmp_path / "a")
    )
    train.train_and_evaluate(config, str(tmp_path / "b"), stop_after_epoch=1)
    resumed = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    for a, b in zip(_leaves(straight["params"]), _leaves(resumed["params"]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    record = straight["final"]
    # GPipe: S = 2, M = 4 micro-batches of 16 / 2 / 4 = 2 examples; the widest boundary
    # after the mlp's layers 0-2 is its first hidden layer (256 floats), over 5 ticks.
    assert record["pipeline_bubble_fraction"] == 1 / 5
    assert record["stage_bytes_per_step_per_device"] == 2 * 5 * 1 * 2 * 256 * 4 / 2
    assert 0 < record["density"] < 0.2 and record["bytes_per_step_per_device"] > 0
    assert record["time_step"] > 0 and record["time_forward_backward"] > 0
    assert set(straight["params"]) == {"Dense_0", "Dense_1", "Dense_2"}
    with pytest.raises(ValueError, match="pipeline_stages=3 must divide num_devices=4"):
        train.train_and_evaluate(dataclasses.replace(config, pipeline_stages=3), str(tmp_path))
    with pytest.raises(ValueError, match="microbatches=3 .* must divide"):
        train.train_and_evaluate(dataclasses.replace(config, microbatches=3), str(tmp_path))
    with pytest.raises(ValueError, match="needs --pipeline_stages"):
        train.train_and_evaluate(dataclasses.replace(TINY, microbatches=2), str(tmp_path))
    # A bool is not a count (True == 1 would pass an int check).
    with pytest.raises(ValueError, match="pipeline_stages must be an int .* got True"):
        train.validate_config(dataclasses.replace(config, pipeline_stages=True), 4)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1 .* got True"):
        train.validate_config(dataclasses.replace(config, microbatches=True), 4)


@pytest.mark.parametrize("compressor", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_compressed_adam_checkpoints_and_resumes(tmp_path, compressor):
    # Their state holds a zero-size leaf (the server error of the all-gather
    # exchange), which orbax refuses to save: the first checkpoint crashed.
    freeze = "var_freeze_step" if compressor == "zero_one_adam" else "freeze_step"
    config = dataclasses.replace(
        TINY,
        compressor=compressor,
        compressor_kwargs={freeze: 2},
        epochs=2,
        checkpoint=True,
        time_split=False,
    )
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))
    train.train_and_evaluate(config, str(tmp_path / "b"), stop_after_epoch=1)
    resumed = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    for a, b in zip(_leaves(straight["params"]), _leaves(resumed["params"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Under a constant schedule a run may be extended, but the default freeze step is a
    # fifth of the total: extended, the resumed run would freeze where no run of that
    # length does.
    record = workdir_lib.config_record(config, 2)["config"]
    longer = workdir_lib.config_record(dataclasses.replace(config, epochs=3), 2)["config"]
    assert record["schedule"] == "constant"
    assert workdir_lib.config_differences(record, longer) == []  # freeze_step given
    unset = {**record, "compressor_kwargs": {}}
    assert workdir_lib.config_differences(unset, {**longer, "compressor_kwargs": {}}) == [
        "epochs=2 there, 3 now"
    ]


def _leaves(tree):
    return jax.tree.leaves(tree)


def _pickled(obj) -> bytes:
    return pickle.dumps(obj, protocol=2)


def _write_tiny_cifar(path, n_train=4, n_test=3, seed=0):
    rng = np.random.default_rng(seed)

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
    # A label off [0, 10) would train on NaN losses (10..) or a wrong class (-1).
    for label in (10, -1):
        bad = tmp_path / f"bad{label}"
        shutil.copytree(tmp_path / "x", bad)
        batch_file = next(bad.rglob("data_batch_3"))
        labels = [label, *files["data_batch_3"][b"labels"][1:]]
        content = files["data_batch_3"] | {b"labels": labels}
        batch_file.write_bytes(_pickled(content))
        with pytest.raises(ValueError, match=rf"labels must be in \[0, 10\), got \[{label}\]"):
            data_lib.load_cifar("cifar10", str(bad))


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
        ({"compressor": "ldte_bs", "compressor_kwargs": {"ratio": 0.0}}, "ratio"),
        ({"compressor": "ldte_bs", "compressor_kwargs": {"ratio": 1.5}}, "ratio"),
        ({"batch_size": 15}, "divisible"),
        ({"compressor": "qsgd", "compressor_kwargs": {"levels": 0}}, "levels"),
        ({"compressor": "onebit", "momentum_correction": True}, "momentum_correction"),
        ({"warmup_epochs": 2}, "sparsifier"),
        ({"num_devices": 64}, "devices exist"),
        ({"model": "vgg"}, "unknown model"),
        ({"dataset": "mnist"}, "unknown dataset"),
        ({"schedule": "linear"}, "schedule"),
        ({"num_processes": 2}, "go together"),
        ({"lr": float("inf")}, "finite lr"),
        ({"lr": float("nan")}, "finite lr"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32 + 1}, "seed"),  # jax.random.key would make it 1
        ({"seed": 1.5}, "seed"),
        ({"data_dir": "/tmp/cifar-10-python.tar.gz"}, "data_dir"),  # dataset: synthetic
        ({"download": True}, "download"),
        # Rejected by the jaxcomp factories: the optimizer is built (abstractly) in validation.
        (
            {"compressor": "qsgd", "compressor_kwargs": {"levels": 3 * 10**9}},
            r"qsgd \(--compressor_kwargs\): levels must be .* \[1, 2147483647\]",
        ),
        (
            {"compressor": "onebit_adam", "compressor_kwargs": {"freeze_step": 2**63 - 1}},
            r"freeze_step must be an integer in \[1,",
        ),
        # The library's name: var_freeze_step + 1 must fit in int32.
        (
            {"compressor": "zero_one_adam", "compressor_kwargs": {"var_freeze_step": 2**31 - 1}},
            r"var_freeze_step must be an integer in \[1, 2147483646\]",
        ),
        (
            {"compressor": "zero_one_adam", "compressor_kwargs": {"var_freeze_step": 0}},
            r"var_freeze_step must be an integer in \[1,",
        ),
        (
            {"compressor": "random_k", "compressor_kwargs": {"reuse_period": 5}},
            "reuse_period must be 1 with an index-based selector",
        ),
        ({"compressor": "top_k", "compressor_kwargs": {"nope": 1}}, "argument 'nope'"),
        # The synthetic set's 2048 examples, known without reading the data.
        ({"batch_size": 100_000}, "batch_size=100000 .* exceeds the 2048 training examples"),
    ],
)
def test_invalid_config_fails_before_training(tmp_path, overrides, message):
    config = dataclasses.replace(TINY, **overrides)
    with pytest.raises(train.ConfigError, match=f"^invalid config: .*{message}") as info:
        train.validate_config(config, jax.device_count())  # what main.py runs first
    assert "\n" not in str(info.value)
    workdir = tmp_path / "w"
    with pytest.raises(train.ConfigError, match=message):
        train.train_and_evaluate(config, str(workdir))
    assert not workdir.exists()  # no config.json, nothing a rerun would trust


def test_main_rejects_bad_flags_before_training(tmp_path, capsys):
    # From the command line: absl's app.run rejects a bad flag value, cli.fail a bad
    # setting, each without a traceback (one process each: a process imports JAX in ~1 s).
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for args, message in [
        (["--compressor=foo"], "compressor"),
        (["--compressor=qsgd", "--compressor_kwargs={bad json"], "compressor_kwargs"),
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
        assert "Traceback" not in proc.stderr
    # The rest through main() in this process: cli.fail is the same one line on stderr and
    # exit status 2 from Python, and main fails before any JAX work (no backend, no compile).
    from experiments import main  # noqa: PLC0415

    for args, message in [
        (["--compressor=qsgd", "--levels=0"], "levels"),
        (["--compressor=qsgd", "--ratio=0.01"], "unexpected keyword argument 'ratio'"),
        (["--compressor=qsgd", "--compressor_kwargs=levels=4,nope=1"], "argument 'nope'"),
        (["--compressor=qsgd", "--levels=4", "--compressor_kwargs=levels=8"], "differ"),
        # Recursive doubling: refused with the config (it used to die at the first step,
        # after config.json, metrics.jsonl and checkpoints/ were written).
        (
            ["--compressor=top_k", "--exchange=gtopk", "--num_devices=3", "--batch_size=63"],
            "needs a power-of-two number of devices along the axis, got 3",
        ),
        (
            ["--compressor=ldte_bs", "--exchange=sparcml", "--num_devices=6", "--batch_size=60"],
            "exchange='sparcml' pairs devices by recursive doubling",
        ),
        (["--compressor=qsgd", "--levels=3000000000"], "levels must be an integer"),
        (["--batch_size=100000"], "exceeds the 1438 training examples"),  # digits
        (["--pipeline_stages=3", "--num_devices=8"], "pipeline_stages=3 must divide"),
        (["--pipeline_stages=2", "--model=cnn"], "does not work with a model other than mlp"),
        (["--microbatches=2"], "microbatches (--microbatches) needs --pipeline_stages"),
    ]:
        with _logging_levels_kept(), pytest.raises(SystemExit) as exit_:
            main.main(["main", f"--workdir={tmp_path}", *args])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2, (args, err)
        assert message in err and "Traceback" not in err and len(err.splitlines()) == 1, err
        assert out == ""
    assert os.listdir(tmp_path) == []  # not even config.json


@contextlib.contextmanager
def _logging_levels_kept():
    """main() sets absl's verbosity and the jax/orbax/absl loggers' levels: restored after."""
    import logging  # noqa: PLC0415

    from absl import logging as absl_logging  # noqa: PLC0415

    verbosity = absl_logging.get_verbosity()
    levels = {n: logging.getLogger(n).level for n in ("jax", "orbax", "absl")}
    try:
        yield
    finally:
        absl_logging.set_verbosity(verbosity)
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def test_every_config_field_has_a_flag():
    from experiments import cli, main  # noqa: PLC0415

    names = {f.name for f in dataclasses.fields(train.TrainConfig)}
    assert names <= set(cli.parse(main.define_flags, ["main"]))


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
        time_split=False,
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


def test_vgg16_size():
    # Shapes only: the CIFAR VGG-16 of the papers (kuangliu/pytorch-cifar's
    # VGG('VGG16'), 14,728,266 parameters with BatchNorm) minus its 4,224 conv
    # biases (ours have none: GroupNorm's shift follows each conv).
    from experiments import models  # noqa: PLC0415

    model = models.make_model("vgg16", 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
    assert count == 14_728_266 - 4_224
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(shapes)]
    assert sum("Conv" in p for p in paths) == 13


def _param_count(name):
    from experiments import models  # noqa: PLC0415

    model = models.make_model(name, 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.zeros((1, 32, 32, 3), np.float32))
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))


def test_ldte_bs_table1_model_sizes():
    # Shapes only. AlexNet: bearpaw/pytorch-classification's CIFAR variant
    # (conv 11x11/4 64, 5x5 192, 3x3 384, 256, 256, all with biases; one
    # dense 256 -> 10): its README's 2.47M.
    convs = [(11, 3, 64), (5, 64, 192), (3, 192, 384), (3, 384, 256), (3, 256, 256)]
    alexnet = sum(k * k * i * o + o for k, i, o in convs) + 256 * 10 + 10
    assert _param_count("alexnet") == alexnet == 2_472_266
    # VGG-19 (kuangliu/pytorch-cifar): 16 3x3 convs, a norm (scale, shift) after
    # each in place of the conv bias, one dense 512 -> 10. With the 5,504 conv
    # biases it is kuangliu's 20,040,522.
    widths = [64] * 2 + [128] * 2 + [256] * 4 + [512] * 8
    ins = [3, *widths[:-1]]
    vgg19 = sum(9 * i * o + 2 * o for i, o in zip(ins, widths, strict=True)) + 512 * 10 + 10
    assert _param_count("vgg19") == vgg19 == 20_040_522 - sum(widths)
    # SENet-18 (kuangliu's PreActBlock): stem conv + norm; per block norm(in),
    # conv 3x3 in->p, norm(p), conv 3x3 p->p, 1x1 shortcut when the shape
    # changes, SE p -> p/16 -> p with biases; one dense 512 -> 10: 11.26M.
    senet, cin = 27 * 64 + 2 * 64, 64
    for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for s in (stride, 1):
            senet += 2 * cin + 9 * cin * planes + 2 * planes + 9 * planes * planes
            senet += cin * planes if (s != 1 or cin != planes) else 0
            r = planes // 16
            senet += planes * r + r + r * planes + planes
            cin = planes
    assert _param_count("senet18") == senet + 512 * 10 + 10 == 11_260_354


@pytest.mark.parametrize("name", ["alexnet", "vgg19", "senet18"])
def test_ldte_bs_table1_models_forward(name):
    from experiments import models  # noqa: PLC0415

    norm = "batch" if name in models.NORMALIZED else "group"
    model = models.make_model(name, 10, norm=norm)
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    variables = model.init(jax.random.key(0), x[:1])
    logits = model.apply(variables, x)
    assert logits.shape == (2, 10) and np.all(np.isfinite(logits))
    # The two images give different logits: the features reach the classifier.
    assert not np.allclose(logits[0], logits[1])


# Issue 8 item 4: a workdir only ever resumes its own configuration.


def test_workdir_refuses_another_config_and_overwrite_starts_fresh(tmp_path):
    workdir = str(tmp_path / "w")
    dense = dataclasses.replace(TINY, checkpoint=True, time_split=False)
    train.train_and_evaluate(dense, workdir)
    metrics = (tmp_path / "w" / "metrics.jsonl").read_text()
    top_k = dataclasses.replace(dense, compressor="top_k", compressor_kwargs={"ratio": 0.05})
    with pytest.raises(ValueError, match="compressor='dense' there, 'top_k' now") as info:
        train.train_and_evaluate(top_k, workdir)
    assert "--overwrite" in str(info.value)
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == metrics  # untouched
    # checkpoint is resumable, but without checkpoints the run would start over and
    # rewrite the metrics (a later resume then mixed two runs' records).
    no_checkpoint = dataclasses.replace(dense, checkpoint=False)
    with pytest.raises(train.WorkdirError, match="checkpoint=False"):
        train.train_and_evaluate(no_checkpoint, workdir)
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == metrics

    # The reverse: a finished checkpoint=False run (its metrics, no checkpoint)
    # rerun with checkpoints on would start over and truncate its records.
    no_checkpoint_dir = str(tmp_path / "n")
    two = dataclasses.replace(no_checkpoint, epochs=2)
    done = train.train_and_evaluate(two, no_checkpoint_dir)
    saved = (tmp_path / "n" / "metrics.jsonl").read_text()
    assert [json.loads(line)["epoch"] for line in saved.splitlines()] == [1, 2]
    for rerun in (dataclasses.replace(dense, epochs=1), dataclasses.replace(dense, epochs=2)):
        with pytest.raises(train.WorkdirError, match="holds a run with checkpoint=False") as info:
            train.train_and_evaluate(rerun, no_checkpoint_dir)
        assert "another --workdir" in str(info.value)
        assert (tmp_path / "n" / "metrics.jsonl").read_text() == saved
    assert done["records"] == [json.loads(line) for line in saved.splitlines()]

    new = train.train_and_evaluate(top_k, workdir, overwrite=True)
    # Resuming the dense epoch-1 checkpoint would train nothing and report the
    # dense record (density -1); the new run trained top_k's epoch.
    lines = [json.loads(line) for line in open(tmp_path / "w" / "metrics.jsonl")]
    assert lines == new["records"] and [r["epoch"] for r in lines] == [1]
    assert 0 < new["final"]["density"] < 0.2  # top_k's at ratio 0.05, not dense's -1
    dense_bytes = json.loads(metrics.splitlines()[0])["bytes_per_step_per_device"]
    assert new["final"]["bytes_per_step_per_device"] < dense_bytes / 5
    stored = json.loads((tmp_path / "w" / train.CONFIG_FILE).read_text())["config"]
    assert stored["compressor"] == "top_k" and stored["compressor_kwargs"]["ratio"] == 0.05


def test_epochs_grow_on_resuming_and_a_shrink_is_refused(tmp_path):
    workdir = str(tmp_path / "w")
    config = dataclasses.replace(TINY, checkpoint=True, time_split=False)  # constant schedule
    train.train_and_evaluate(config, workdir)
    longer = train.train_and_evaluate(dataclasses.replace(config, epochs=3), workdir)
    assert [r["epoch"] for r in longer["records"]] == [1, 2, 3]  # grown: epochs 2, 3 trained
    metrics = (tmp_path / "w" / "metrics.jsonl").read_text()
    for epochs in (1, 2):
        # Shrunk, the rerun trained nothing and config.json claimed fewer epochs than held.
        with pytest.raises(train.WorkdirError, match=rf"epochs=3 \(3 done\), epochs={epochs} now"):
            train.train_and_evaluate(dataclasses.replace(config, epochs=epochs), workdir)
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == metrics
    assert json.loads((tmp_path / "w" / train.CONFIG_FILE).read_text())["config"]["epochs"] == 3
    # Stopped after epoch 1 of 3: still a shrink of the run's schedule.
    other = str(tmp_path / "o")
    train.train_and_evaluate(dataclasses.replace(config, epochs=3), other, stop_after_epoch=1)
    with pytest.raises(train.WorkdirError, match=r"epochs=3 \(1 done\), epochs=2 now"):
        train.train_and_evaluate(dataclasses.replace(config, epochs=2), other)


def test_workdir_without_config_or_with_bad_checkpoint_is_a_clear_error(tmp_path):
    workdir = tmp_path / "w"
    config = dataclasses.replace(TINY, checkpoint=True, time_split=False, epochs=2)
    train.train_and_evaluate(config, str(workdir), stop_after_epoch=1)
    config_json = (workdir / train.CONFIG_FILE).read_text()

    def refused(cfg, match):
        with pytest.raises(ValueError, match=match) as info:
            train.train_and_evaluate(cfg, str(workdir))
        assert isinstance(info.value, train.WorkdirError)
        # No orbax exception chained to it (a traceback would print it).
        err = info.value
        assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
        assert "--overwrite" in str(info.value)

    # Older layout: checkpoints without config.json.
    (workdir / train.CONFIG_FILE).unlink()
    refused(config, "no config.json")
    # A checkpoint whose structure is not this config's (config.json claims it is).
    other = dataclasses.replace(config, compressor="onebit")
    (workdir / train.CONFIG_FILE).write_text(
        json.dumps(workdir_lib.config_record(train.resolve_config(other), 2))
    )
    refused(other, "cannot restore the epoch-1 checkpoint")
    # A corrupted checkpoint.
    (workdir / train.CONFIG_FILE).write_text(config_json)
    for path in (workdir / "checkpoints").rglob("*"):
        if path.is_file() and "default" in path.parts:
            path.write_bytes(b"garbage")
    refused(config, "cannot restore the epoch-1 checkpoint")
    (workdir / train.CONFIG_FILE).write_text("{not json")
    refused(config, "not a valid run configuration")


def test_resume_on_other_data_is_refused_and_the_same_data_elsewhere_resumes(tmp_path):
    # data_dir may change on resuming (the files moved), the data may not: a
    # run resumed on another CIFAR trained epoch 1 on one set and epoch 2 on another.
    a, bigger, other = (tmp_path / f"{n}.tar.gz" for n in ("a", "bigger", "other"))
    _write_tiny_cifar(a)
    _write_tiny_cifar(bigger, n_train=8, n_test=5, seed=1)
    _write_tiny_cifar(other, seed=1)  # the same sizes, other pixels and labels
    workdir = str(tmp_path / "w")
    config = dataclasses.replace(
        TINY, dataset="cifar10", data_dir=str(a), batch_size=4, epochs=2, checkpoint=True,
        time_split=False,
    )  # fmt: skip
    train.train_and_evaluate(config, workdir, stop_after_epoch=1)
    metrics = (tmp_path / "w" / "metrics.jsonl").read_text()
    stored = json.loads((tmp_path / "w" / train.CONFIG_FILE).read_text())["data"]
    assert stored["train_examples"] == 5 * 4 and stored["test_examples"] == 3
    assert stored["image_shape"] == [32, 32, 3]
    with pytest.raises(train.WorkdirError, match="train_examples=20 there, 40 now") as info:
        train.train_and_evaluate(dataclasses.replace(config, data_dir=str(bigger)), workdir)
    assert "test_examples=3 there, 5 now" in str(info.value) and "--overwrite" in str(info.value)
    with pytest.raises(train.WorkdirError, match="fingerprint="):
        train.train_and_evaluate(dataclasses.replace(config, data_dir=str(other)), workdir)
    assert (tmp_path / "w" / "metrics.jsonl").read_text() == metrics  # untouched
    # The same archive extracted elsewhere is the same data: it resumes.
    with tarfile.open(a) as tar:
        tar.extractall(tmp_path / "moved", filter="data")
    moved = dataclasses.replace(config, data_dir=str(tmp_path / "moved"))
    result = train.train_and_evaluate(moved, workdir)
    assert [r["epoch"] for r in result["records"]] == [1, 2]
    # A config.json written before the data were recorded: unknown, accepted
    # (and recorded from then on).
    path = tmp_path / "w" / train.CONFIG_FILE
    record = json.loads(path.read_text())
    del record["data"]
    path.write_text(json.dumps(record))
    workdir_lib.check_workdir(
        train.resolve_config(moved), workdir, 2, False, workdir_lib.data_record(
            data_lib.load_cifar("cifar10", str(other))
        ),
    )  # fmt: skip
    assert json.loads(path.read_text())["data"]["fingerprint"] != stored["fingerprint"]


# Issue 8 items 4 and 15 through the command line: clean errors, quiet logs.

_MAIN_TINY = [
    "--num_devices=2",
    "--dataset=synthetic",
    "--epochs=1",
    "--batch_size=16",
    "--max_steps_per_epoch=2",
    "--noprogress",
    "--notime_split",
]


def _run_main(*args):
    # No simulated device count in XLA_FLAGS: --num_devices must create the devices.
    env = {**os.environ, "XLA_FLAGS": compile_flags_without_devices(), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "experiments.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        check=False,
    )


def _info_lines(text):
    # absl's format "I1122 21:57:28.123 ..." and python logging's "INFO:...".
    return [ln for ln in text.splitlines() if re.match(r"I\d{4} |INFO", ln)]


def test_main_refuses_mismatched_workdir_and_is_quiet(tmp_path):
    workdir = f"--workdir={tmp_path}"
    # Without a simulated device count in XLA_FLAGS: --num_devices=2 alone must create the devices
    # (a plain CPU has one, and validation would reject num_devices=2).
    first = _run_main(workdir, "--compressor=dense", *_MAIN_TINY)  # checkpoints on
    assert first.returncode == 0, first.stderr[-2000:]
    assert _info_lines(first.stderr) == [], first.stderr[:2000]  # orbax logs INFO per save

    second = _run_main(workdir, "--compressor=top_k", *_MAIN_TINY)
    assert second.returncode != 0
    assert "compressor='dense' there, 'top_k' now" in second.stderr
    assert "--overwrite" in second.stderr and "Traceback" not in second.stderr

    third = _run_main(workdir, "--compressor=top_k", "--overwrite", "--verbose", *_MAIN_TINY)
    assert third.returncode == 0, third.stderr[-2000:]
    assert _info_lines(third.stderr)  # --verbose: the INFO lines are there to be seen
    (record,) = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert 0 < record["density"] < 0.01  # top_k at the default ratio 1e-3, not dense


def test_main_missing_cifar_names_the_flags(tmp_path):
    proc = _run_main(
        f"--workdir={tmp_path}", "--dataset=cifar10", f"--data_dir={tmp_path / 'nope.tar.gz'}"
    )
    assert proc.returncode != 0
    assert "--data_dir" in proc.stderr and "--download" in proc.stderr
    assert "Traceback" not in proc.stderr and "download=True" not in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_unreadable_cifar_is_an_invalid_config_before_the_workdir(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    files = _write_tiny_cifar(archive)  # 20 training images
    blob = archive.read_bytes()
    garbage, truncated = tmp_path / "garbage.tar.gz", tmp_path / "truncated.tar.gz"
    garbage.write_bytes(b"not an archive" * 100)
    truncated.write_bytes(blob[: len(blob) // 2])
    # An archive whose batch is not a pickle.
    not_pickled = tmp_path / "not_pickled.tar.gz"
    with tarfile.open(not_pickled, "w:gz") as tar:
        for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = 8
            tar.addfile(info, io.BytesIO(b"garbage!"))
    base = dataclasses.replace(TINY, dataset="cifar10", time_split=False)
    cases = [
        (garbage, "not a readable cifar10 archive"),
        (truncated, "not a readable cifar10 archive"),
        (not_pickled, "data_batch_1 is not a pickled CIFAR batch"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            data_lib.load_cifar("cifar10", str(path))
        assert "\n" not in str(info.value)
        workdir = tmp_path / f"run_{path.stem}"
        config = dataclasses.replace(base, data_dir=str(path))
        with pytest.raises(train.ConfigError, match=f"^invalid config: .*{message}"):
            train.train_and_evaluate(config, str(workdir))
        assert not workdir.exists()
    # A batch larger than this smaller CIFAR set: known only once the data is read.
    config = dataclasses.replace(base, data_dir=str(archive), batch_size=32)
    train.validate_config(config, jax.device_count())  # the standard set has 50000
    with pytest.raises(train.ConfigError, match="batch_size=32 .* the 20 training examples"):
        train.train_and_evaluate(config, str(tmp_path / "run_big_batch"))
    assert not (tmp_path / "run_big_batch").exists()
    # More evaluation examples than the test set holds: refused (clamped, the
    # run claimed a subset it did not evaluate on); the whole set is accepted.
    num_test = len(files["test_batch"][b"labels"])
    small = dataclasses.replace(base, data_dir=str(archive), batch_size=4)
    with pytest.raises(
        train.ConfigError, match=f"eval_examples={num_test + 1} .* the {num_test} test examples"
    ):
        train.train_and_evaluate(
            dataclasses.replace(small, eval_examples=num_test + 1), str(tmp_path / "run_eval")
        )
    assert not (tmp_path / "run_eval").exists()
    whole = train.train_and_evaluate(small, str(tmp_path / "run_all"))["final"]
    exact = train.train_and_evaluate(
        dataclasses.replace(small, eval_examples=num_test), str(tmp_path / "run_exact")
    )["final"]
    assert exact["test_accuracy"] == whole["test_accuracy"]
    # Through the command line: one line, no traceback, nothing written.
    proc = _run_main(
        f"--workdir={tmp_path / 'run_main'}", "--dataset=cifar10", f"--data_dir={garbage}"
    )
    assert proc.returncode != 0
    assert "invalid config" in proc.stderr and "not a readable cifar10 archive" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run_main").exists()


def test_dataset_specs_are_what_the_loaders_return(tmp_path):
    archive = tmp_path / "cifar-10-python.tar.gz"
    _write_tiny_cifar(archive)
    loaded = {
        "digits": data_lib.load_dataset("digits"),
        "synthetic": data_lib.load_dataset("synthetic"),
        "cifar10": data_lib.load_cifar("cifar10", str(archive)),
    }
    for name, ds in loaded.items():
        num_train, shape, num_classes = data_lib.DATASET_SPECS[name]
        assert (ds.train_x.shape[1:], ds.num_classes) == (shape, num_classes)
        if name != "cifar10":  # the written archive is smaller than the real one
            assert len(ds.train_y) == num_train


def test_validate_config_starts_no_jax_backend():
    # main.py validates before it sets the CPU device count, which must come first.
    code = (
        "import jax\n"
        "from experiments import train\n"
        "for name in train.COMPRESSORS:\n"
        "    train.validate_config(train.TrainConfig(compressor=name))\n"
        "jax.config.update('jax_num_cpu_devices', 3)\n"
        "print(jax.device_count())\n"
    )
    env = {**os.environ, "XLA_FLAGS": compile_flags_without_devices(), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "3"


def test_nan_loss_is_strict_json_and_reads_back_on_resume(tmp_path):
    # lr 1e30: the second step's loss is NaN, so every epoch's mean is.
    config = dataclasses.replace(TINY, lr=1e30, epochs=2, checkpoint=True, time_split=False)
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    assert np.isnan(first["final"]["train_loss"])
    resumed = train.train_and_evaluate(config, str(tmp_path))  # reads epoch 1 back

    def strict(name):
        raise ValueError(f"not strict JSON: {name}")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    parsed = [json.loads(line, parse_constant=strict) for line in lines]
    assert [r["epoch"] for r in parsed] == [1, 2]
    assert [r["train_loss"] for r in parsed] == [None, None]
    # Read back as the float it was: the records compare, plot and resume as a fresh run's.
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert all(np.isnan(r["train_loss"]) for r in resumed["records"])
    assert all(isinstance(v, (int, float, str)) for r in resumed["records"] for v in r.values())
    assert resumed["records"][0]["test_accuracy"] == first["final"]["test_accuracy"]
    assert (tmp_path / "accuracy.png").exists()


# Issue 8 item 14: every flag applies or is rejected; defaults work everywhere.


@pytest.mark.parametrize("name", train.COMPRESSORS)
def test_every_compressor_builds_with_default_flags(name):
    config = train.TrainConfig(compressor=name)
    train.validate_config(config)
    resolved = train.resolve_config(config)
    # What a run validates again (and a rerun reads back from config.json): a
    # default the resolution fills in must not look like a flag the user gave.
    train.validate_config(resolved)
    assert train.resolve_config(resolved) == resolved
    tx, _ = train.build_optimizer(config, 10, 100)
    state = tx.init({"w": np.zeros(64, np.float32)})
    # Momentum correction: on the compressor for sparsifiers (plain SGD after
    # it), on the optimizer for the others.
    sgd_trace = steps.get_field(state[1], "trace")  # optax.sgd's momentum buffer
    kwargs = resolved.compressor_kwargs
    if name in train.SPARSIFIERS:
        assert resolved.momentum_correction and kwargs["ratio"] == 1e-3
        assert kwargs["granularity"] == "layer" and sgd_trace is None
    elif name == "signum" or name in train.COMPRESSED_OPTIMIZERS:
        # Their momentum is their own: signum sends the sign of it, the Adams are whole
        # optimizers (nothing chained after them).
        assert resolved.momentum_correction is False and sgd_trace is None
    else:
        assert resolved.momentum_correction is False and "ratio" not in kwargs
        assert sgd_trace is not None
    assert (kwargs.get("levels") == 16) == (name == "qsgd")
    assert (kwargs.get("rank") == 4) == (name == "powersgd")


def _unused_cases():
    # Which factory argument each family does not take, stated independently:
    # the factory itself rejects it (Python's TypeError naming the keyword).
    sparse_only = {"ratio": 0.01, "granularity": "global", "low_pass": 0.5}
    qsgd_only = {"levels": 4}
    rank_only = {"rank": 2}
    freeze_only = {"freeze_step": 3}
    unused = {"dense": {**sparse_only, **qsgd_only, "bucket_size": 8, "min_dense_size": 5}}
    unused.update({n: {**qsgd_only, **rank_only, **freeze_only} for n in train.SPARSIFIERS})
    unused.update({n: {**sparse_only, **rank_only, **freeze_only} for n in train.QUANTIZERS})
    unused["qsgd"] = {**sparse_only, **rank_only, **freeze_only}
    unused["powersgd"] = {**sparse_only, **qsgd_only, **freeze_only}
    for n in train.COMPRESSED_OPTIMIZERS:
        unused[n] = {**sparse_only, **qsgd_only, **rank_only}
    # Accordion passes its other arguments to its inner compressor (top_k by default).
    unused["accordion"] = {**qsgd_only, **rank_only, **freeze_only}
    return [(n, k, v) for n in train.COMPRESSORS for k, v in unused[n].items()]


@pytest.mark.parametrize("name, key, value", _unused_cases())
def test_kwarg_the_factory_does_not_take_is_rejected(name, key, value):
    config = train.TrainConfig(compressor=name, compressor_kwargs={key: value})
    with pytest.raises(ValueError, match=f"unexpected keyword argument '{key}'") as info:
        train.validate_config(config)
    assert name in str(info.value) and "\n" not in str(info.value)


def _unused_field_cases():
    # The experiment's own fields that only some compressors use.
    not_sparse = [n for n in train.COMPRESSORS if n not in train.SPARSIFIERS]
    cases = [(n, f, v) for n in not_sparse for f, v in (("merge", "greedy"), ("warmup_epochs", 1))]
    cases += [(q, "momentum_correction", True) for q in not_sparse if q != "dense"]
    cases += [(n, "coded_bytes_every", 2) for n in ("dense", "top_k", "onebit")]
    return cases


@pytest.mark.parametrize("name, field, value", _unused_field_cases())
def test_field_unused_by_the_compressor_is_rejected(name, field, value):
    config = dataclasses.replace(train.TrainConfig(compressor=name), **{field: value})
    with pytest.raises(ValueError, match=f"--{field}") as info:
        train.validate_config(config)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("key", ["seed", "axis_name", "groups", "momentum"])
def test_kwargs_the_experiment_sets_are_rejected(key):
    config = train.TrainConfig(compressor="top_k", compressor_kwargs={key: 1})
    with pytest.raises(ValueError, match=f"compressor_kwargs sets {key}"):
        train.validate_config(config)


@pytest.mark.parametrize(
    "name, min_dense_size, dense",
    [("qsgd", None, True), ("qsgd", 0, False), ("onebit", None, False), ("onebit", 100, True)],
)
def test_min_dense_size_applies_to_quantizers(name, min_dense_size, dense):
    # A 64-element leaf: dense is 4 * 64 bytes; qsgd's own default (10000)
    # sends it dense, onebit's (0) compresses it; the flag overrides both.
    kwargs = {} if min_dense_size is None else {"min_dense_size": min_dense_size}
    config = train.TrainConfig(compressor=name, compressor_kwargs=kwargs)
    _, compressor = train.build_optimizer(config, 10, 100)
    mesh = jax.make_mesh((2,), (train.AXIS,), devices=jax.devices()[:2])
    g = {"w": np.linspace(-1, 1, 64, dtype=np.float32)}
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(train.AXIS))

    def stacked(tree):  # one copy per device
        return jax.device_put(jax.tree.map(lambda a: np.stack([a, a]), tree), sharding)

    _, state = compress_on_mesh(
        compressor, mesh, stacked(g), stacked(compressor.init(g)), train.AXIS
    )
    sent = int(np.asarray(steps.get_field(state, "message_bytes")["w"])[0])
    assert (sent == 4 * 64) == dense and sent <= 4 * 64


def test_step_schedule_is_the_dlgs_papers():
    # DLGS trains CIFAR-10 for 140 epochs: lr 0.1, 0.01 from epoch 80, 0.001 from 120.
    config = dataclasses.replace(TINY, schedule="step", lr=0.1)
    spe = 3
    lr = train.learning_rate(config, spe, 140 * spe)
    for epoch, want in [(0, 0.1), (79, 0.1), (80, 0.01), (119, 0.01), (120, 0.001), (139, 0.001)]:
        for step in (epoch * spe, epoch * spe + spe - 1):
            np.testing.assert_allclose(float(lr(step)), want, rtol=1e-6)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"merge_alpha": 1e-5}, "needs merge="),
        ({"merge": "none", "merge_beta": 1e-9}, "needs merge="),
        ({"merge": "greedy", "merge_alpha": -1e-6}, ">= 0"),
        ({"merge": "optimal", "merge_beta": float("nan")}, ">= 0"),
        ({"merge": "optimal", "merge_alpha": float("inf")}, ">= 0"),
        ({"merge": "optimal", "merge_beta": "fast"}, "real number"),
    ],
)
def test_merge_link_flags_are_checked(overrides, message):
    config = train.TrainConfig(compressor="top_k", **overrides)
    field = next(k for k in overrides if k.startswith("merge_"))
    with pytest.raises(ValueError, match=f"--{field}.*{re.escape(message)}"):
        train.validate_config(config)


def test_merge_link_defaults_to_10_gbe_and_takes_the_flags():
    config = train.TrainConfig(
        compressor="top_k", compressor_kwargs={"ratio": 0.01}, merge="optimal"
    )
    train.validate_config(config)
    # 10 GbE: 50 us per message, 1.25e9 bytes/s; 8 bytes per sent (index, value) pair.
    t_c = train.merge_link_cost(config)
    assert (t_c.alpha, t_c.beta, t_c.bytes_per_element) == (50e-6, 1 / 1.25e9, 8 * 0.01)
    config = dataclasses.replace(config, merge_alpha=2e-6, merge_beta=0.0)
    train.validate_config(config)
    t_c = train.merge_link_cost(config)
    assert (t_c.alpha, t_c.beta) == (2e-6, 0.0)
    assert t_c(10**6) == 2e-6  # a free byte: every message costs its latency alone


def test_merge_link_change_is_another_config():
    config = train.TrainConfig(
        compressor="top_k", compressor_kwargs={"ratio": 0.01}, merge="optimal"
    )
    record = workdir_lib.config_record(config, 2)["config"]
    # A config.json written before the link flags existed: the same run as unset flags.
    older = {k: v for k, v in record.items() if k not in ("merge_alpha", "merge_beta")}
    assert workdir_lib.config_differences(older, record) == []
    faster = workdir_lib.config_record(dataclasses.replace(config, merge_alpha=np.float32(5e-6)), 2)
    assert type(faster["config"]["merge_alpha"]) is float  # JSON-writable, whatever real was given
    diffs = workdir_lib.config_differences(record, faster["config"])
    assert len(diffs) == 1 and diffs[0].startswith("merge_alpha=None there")


def test_merge_plan_is_written_and_reused_on_resume(tmp_path, monkeypatch):
    from jaxcomp import planning  # noqa: PLC0415

    config = dataclasses.replace(
        TINY,
        compressor="ldte_bs",
        compressor_kwargs={"ratio": 0.01, "reuse_period": 2},
        merge="optimal",
        # A link whose every message costs a second: one message (one group) is optimal.
        merge_alpha=1.0,
        epochs=2,
        checkpoint=True,
        time_split=False,
    )
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    path = tmp_path / train.MERGE_PLAN_FILE
    plan = json.loads(path.read_text())
    assert plan == first["merge_plan"]
    assert plan["method"] == "optimal" and plan["profile"]["method"] == "flops"
    assert plan["t_c"] == {"alpha": 1.0, "beta": train.MERGE_BETA, "bytes_per_element": 0.08}
    assert len(plan["layer_groups"]) == 1 < len(plan["layers"])
    flat = [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(first["params"])[0]
    ]
    listed = [p for g in plan["groups"] for p in g]
    assert sorted(listed) == sorted(flat) and len(listed) == len(flat)
    assert plan["predicted_time"] == plan["predicted_times"]["optimal"]
    assert plan["predicted_times"]["optimal"] <= min(plan["predicted_times"].values())
    assert np.isfinite(first["final"]["train_loss"])

    # The resumed run reuses the plan: nothing is profiled again.
    def fail(*args, **kwargs):
        raise AssertionError("a resumed run must reuse merge_plan.json")

    monkeypatch.setattr(planning, "profile_backward", fail)
    monkeypatch.setattr(planning, "measure_sparsify_cost", fail)
    text = path.read_text()
    resumed = train.train_and_evaluate(config, str(tmp_path))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert np.isfinite(resumed["final"]["train_loss"])
    assert resumed["merge_plan"]["groups"] == plan["groups"]
    assert path.read_text() == text


# CSSGD runs (--exchange=coded/uncoded --redundancy=r, jaxcomp.cssgd).

# 4 devices, r = 2: C(4, 2) = 6 blocks of 4 examples, 3 on each device.
CODED = dataclasses.replace(
    TINY, num_devices=4, batch_size=24, exchange="coded", redundancy=2, time_split=False
)


def _assert_same_params(a, b):
    leaves_a, leaves_b = _leaves(a), _leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_coded_run_records_multicast_bytes_and_time_split(tmp_path):
    config = dataclasses.replace(CODED, time_split=True)
    result = train.train_and_evaluate(config, str(tmp_path))
    (record,) = result["records"]
    expected = jaxcomp.cssgd.bytes_per_worker(4, 2, result["num_params"])
    assert record["bytes_per_step_per_device"] == expected["coded_sent"]
    assert record["message_bytes_per_step_per_device"] == expected["coded_sent"]
    assert record["received_bytes_per_step_per_device"] == expected["coded_received"]
    assert record["cumulative_bytes_per_device"] == 2 * expected["coded_sent"]  # 2 steps
    assert record["density"] == -1.0
    assert (record["exchange"], record["redundancy"]) == ("coded", 2)
    assert record["clipped"] == 0 and record["nonfinite"] == 0  # |gradients| << 10
    assert np.isfinite(record["train_loss"])
    # The split of CSSGD's step: per-block gradients, coding, exposed all-gather.
    assert record["time_forward_backward"] > 0 and record["time_step"] > 0
    again = jaxcomp.distributed.split_step_time(
        record["time_forward_backward"],
        record["time_step_without_communication"],
        record["time_step"],
    )
    assert [record[f"time_{k}"] for k in train.TIME_SPLIT_FIELDS] == list(again)
    assert (tmp_path / "time_split.png").stat().st_size > 0
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == result["records"]
    stored = json.loads((tmp_path / train.CONFIG_FILE).read_text())["config"]
    assert (stored["exchange"], stored["redundancy"]) == ("coded", 2)
    assert (stored["coded_value_range"], stored["coded_bits"]) == (10.0, 32)  # the paper's


def test_coded_and_uncoded_decode_the_same_gradient(tmp_path):
    coded = train.train_and_evaluate(CODED, str(tmp_path / "coded"))
    uncoded = train.train_and_evaluate(
        dataclasses.replace(CODED, exchange="uncoded"), str(tmp_path / "uncoded")
    )
    # Integer decoding is exact: the same mean gradient, bit for bit.
    _assert_same_params(coded["params"], uncoded["params"])
    assert coded["final"]["train_loss"] == uncoded["final"]["train_loss"]
    expected = jaxcomp.cssgd.bytes_per_worker(4, 2, coded["num_params"])
    assert uncoded["final"]["bytes_per_step_per_device"] == expected["uncoded_sent"]
    # r = 2 halves what the uncoded exchange of the same assignment sends.
    assert 2 * coded["final"]["bytes_per_step_per_device"] == expected["uncoded_sent"]


def test_coded_r1_matches_dense_data_parallel_sgd(tmp_path):
    # r = 1: device k's one block is its shard of the batch, so CSSGD is plain
    # data-parallel SGD with the gradient quantized to int32 over [-10, 10].
    config = dataclasses.replace(CODED, redundancy=1)
    coded = train.train_and_evaluate(config, str(tmp_path / "coded"))
    dense = train.train_and_evaluate(
        dataclasses.replace(config, exchange=None, redundancy=None), str(tmp_path / "dense")
    )
    leaves_c, leaves_d = _leaves(coded["params"]), _leaves(dense["params"])
    assert len(leaves_c) == len(leaves_d)
    for c, d in zip(leaves_c, leaves_d, strict=True):
        # Quantization step 10 / (2^31 - 1) ~ 5e-9 per gradient value.
        np.testing.assert_allclose(np.asarray(c), np.asarray(d), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(coded["final"]["train_loss"], dense["final"]["train_loss"], 1e-5)


def test_coded_resume_gives_identical_parameters_and_counts(tmp_path):
    # A small range so that values are clipped: the counts live in the
    # checkpointed CodedState and continue after a resume.
    config = dataclasses.replace(CODED, epochs=2, checkpoint=True, coded_value_range=0.01)
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))
    first = train.train_and_evaluate(config, str(tmp_path / "b"), stop_after_epoch=1)
    resumed = train.train_and_evaluate(config, str(tmp_path / "b"))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    _assert_same_params(straight["params"], resumed["params"])
    clipped = [r["clipped"] for r in straight["records"]]
    assert 0 < clipped[0] < clipped[1]
    assert [r["clipped"] for r in resumed["records"]] == clipped
    assert first["records"][0]["clipped"] == clipped[0]
    # Redundancy changes the run: not resumable from another r's checkpoint.
    with pytest.raises(ValueError, match="redundancy=2 there, 1 now"):
        train.train_and_evaluate(dataclasses.replace(config, redundancy=1), str(tmp_path / "b"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"exchange": None}, r"redundancy \(--redundancy\) is only used by CSSGD"),
        ({"exchange": "default"}, r"--redundancy\) is only used by CSSGD"),
        (
            {"exchange": None, "redundancy": None, "coded_bits": 16},
            r"--coded_bits\) is only used by CSSGD",
        ),
        (
            {"exchange": None, "redundancy": None, "coded_value_range": 1.0},
            r"--coded_value_range\) is only used by CSSGD",
        ),
        ({"redundancy": None}, r"needs redundancy \(--redundancy\)"),
        ({"compressor": "ldte_bs"}, "needs compressor='dense'.*cannot be coded"),
        ({"compressor": "qsgd"}, "needs compressor='dense'.*cannot be coded"),
        ({"batch_size": 16}, r"multiple of C\(num_devices, redundancy\) = C\(4, 2\) = 6"),
        ({"redundancy": 5, "batch_size": 20}, r"redundancy .* \[1, num_devices=4\].*got 5"),
        ({"redundancy": 0}, "redundancy"),
        ({"exchange": "multicast"}, "exchange"),
        ({"coded_bits": 12}, "coded_bits"),
        ({"coded_value_range": 0.0}, "coded_value_range"),
        ({"fit_check_epochs": (1,)}, "fit_check_epochs"),
        ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 0}, "one process"),
    ],
)
def test_invalid_coded_config_fails_before_training(tmp_path, overrides, message):
    config = dataclasses.replace(CODED, **overrides)
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_coded_batch_needs_no_divisibility_by_the_devices():
    # 18 = 3 * C(4, 2): every device holds 3 blocks of 3 examples, though 4 does not divide 18.
    config = dataclasses.replace(CODED, batch_size=18)
    train.validate_config(config, 8)
    assert train.build_optimizer(config, 2, 2)[1] is None  # plain sgd, no compressor
    with pytest.raises(ValueError, match="divisible"):
        train.validate_config(dataclasses.replace(config, exchange=None, redundancy=None), 8)


def test_main_coded_flags_make_the_config():
    from experiments import cli, main  # noqa: PLC0415

    args = ["--compressor=dense", "--exchange=uncoded", "--redundancy=3"]
    argv = ["main", *args, "--coded_bits=16", "--coded_value_range=5"]
    config = main.config_from_flags(cli.parse(main.define_flags, argv))
    assert (config.exchange, config.redundancy) == ("uncoded", 3)
    assert (config.coded_bits, config.coded_value_range) == (16, 5.0)
    train.validate_config(config)
    resolved = train.resolve_config(dataclasses.replace(config, coded_bits=None))
    assert resolved.coded_bits == 32


@pytest.mark.parametrize(
    "compressor, exchange",
    [("top_k", "gtopk"), ("ldte_bs", "oktopk"), ("qsgd", "server"), ("top_k", "scalecom")],
)
def test_compressor_exchange_reaches_the_compressor(monkeypatch, compressor, exchange):
    seen = {}
    real = getattr(jaxcomp, compressor)

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(jaxcomp, compressor, spy)
    config = dataclasses.replace(TINY, compressor=compressor, exchange=exchange, num_devices=2)
    train.validate_config(config)
    train.build_optimizer(config, 2, 2)
    assert (seen["exchange"], seen["axis_name"]) == (exchange, train.AXIS)


def test_a_sparse_allreduce_run_trains(tmp_path):
    # The program's step with an exchange other than the all-gather, end to end (every
    # exchange under the step's shard_map: tests/test_sparse_allreduce.py).
    config = dataclasses.replace(
        TINY, compressor="ldte_bs", exchange="oktopk", time_split=False, num_devices=2
    )
    result = train.train_and_evaluate(config, str(tmp_path))
    record = result["final"]
    assert np.isfinite(record["train_loss"]) and record["bytes_per_step_per_device"] > 0
    assert 0.0 <= record["test_accuracy"] <= 1.0


def test_low_pass_reaches_the_sparsifier_and_is_checked(monkeypatch):
    seen = {}
    real = jaxcomp.top_k

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(jaxcomp, "top_k", spy)
    config = dataclasses.replace(
        TINY, compressor="top_k", exchange="scalecom", compressor_kwargs={"low_pass": 0.25}
    )
    train.validate_config(config)
    train.build_optimizer(config, 2, 2)
    assert (seen["low_pass"], seen["exchange"]) == (0.25, "scalecom")
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="low_pass"):
            train.validate_config(dataclasses.replace(config, compressor_kwargs={"low_pass": bad}))


@pytest.mark.parametrize(
    "compressor, exchange",
    [("dense", "gtopk"), ("qsgd", "gtopk"), ("top_k", "majority"), ("top_k", "nope")],
)
def test_exchange_the_compressor_lacks_is_rejected(compressor, exchange):
    config = dataclasses.replace(TINY, compressor=compressor, exchange=exchange)
    with pytest.raises(ValueError, match="exchange"):
        train.validate_config(config)


# config.json as the program wrote it before compressor_kwargs: the factory
# arguments as flat fields (a literal record of that format, resolved: the
# sparsifiers' ratio, granularity and reuse_period filled in).
_FLAT_RECORD = {
    "compressor": "ldte_bs",
    "ratio": 0.01,
    "warmup_epochs": 1,
    "momentum": 0.9,
    "momentum_correction": True,
    "granularity": "layer",
    "reuse_period": 1,
    "low_pass": None,
    "merge": "none",
    "merge_alpha": None,
    "merge_beta": None,
    "min_dense_size": None,
    "levels": None,
    "bits": None,
    "bucket_size": None,
    "num_devices": 2,
    "dataset": "synthetic",
    "data_dir": None,
    "download": False,
    "model": "mlp",
    "epochs": 2,
    "batch_size": 16,
    "lr": 0.05,
    "schedule": "constant",
    "seed": 0,
    "progress": False,
    "checkpoint": True,
    "time_split": False,
    "max_steps_per_epoch": 2,
    "coded_bytes_every": None,
    "coordinator_address": None,
    "num_processes": None,
    "process_id": None,
    "fit_check_epochs": [],
    "exchange": None,
    "redundancy": None,
    "coded_value_range": None,
    "coded_bits": None,
    "sampling": "global",
    "rank": None,
    "freeze_step": None,
    "lr_milestones": [],
    "lr_decay": 0.1,
    "weight_decay": 0.0,
    "norm": "group",
    "augment": False,
    "eval_examples": None,
}


def test_flat_config_json_of_older_runs_resumes(tmp_path):
    config = dataclasses.replace(
        TINY,
        compressor="ldte_bs",
        compressor_kwargs={"ratio": 0.01},
        warmup_epochs=1,
        epochs=2,
        checkpoint=True,
        time_split=False,
    )
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    path = tmp_path / train.CONFIG_FILE
    data = json.loads(path.read_text())["data"]
    path.write_text(json.dumps({"format": 1, "config": _FLAT_RECORD, "data": data}))
    resumed = train.train_and_evaluate(config, str(tmp_path))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert resumed["records"][0] == first["records"][0]
    stored = json.loads(path.read_text())["config"]  # rewritten in today's form
    assert "ratio" not in stored and stored["compressor_kwargs"]["ratio"] == 0.01
    # Another flat value is another run: refused, named in today's terms.
    path.write_text(json.dumps({"format": 1, "config": {**_FLAT_RECORD, "ratio": 0.02}}))
    with pytest.raises(train.WorkdirError, match="compressor_kwargs=.*'ratio': 0.02"):
        train.train_and_evaluate(config, str(tmp_path))


@pytest.mark.parametrize(
    "flat, compressor, kwargs",
    [
        ({"compressor": "ldte_bs_paper", "ratio": 0.05}, "ldte_bs", {"variant": "paper"}),
        ({"compressor": "qsgd", "bits": 4, "bucket_size": 128}, "qsgd", {}),
        ({"compressor": "powersgd", "rank": 2}, "powersgd", {}),
        ({"compressor": "onebit_adam", "freeze_step": 2}, "onebit_adam", {}),
        ({"compressor": "zero_one_adam", "freeze_step": 2}, "zero_one_adam", {}),
        ({"compressor": "top_k", "ratio": 0.05, "reuse_period": 2}, "top_k", {}),
    ],
)
def test_flat_records_map_into_compressor_kwargs(flat, compressor, kwargs):
    # The old record of a run given by the old flags equals the record of
    # the same run given by compressor_kwargs (stated here by hand).
    given = {k: v for k, v in flat.items() if k != "compressor"}
    if compressor == "zero_one_adam":
        given = {"var_freeze_step": given["freeze_step"]}
    config = train.TrainConfig(compressor=compressor, compressor_kwargs={**kwargs, **given})
    record = workdir_lib.config_record(config, 2)["config"]
    old = {k: v for k, v in record.items() if k != "compressor_kwargs"}
    defaults = {"qsgd": {}, "powersgd": {}, "onebit_adam": {}, "zero_one_adam": {}}
    sparse = {"granularity": "layer", "reuse_period": 1}
    old.update(defaults.get(compressor, sparse), **flat)
    assert workdir_lib.config_differences(old, record) == []
    changed = {**old, next(k for k in flat if k != "compressor"): 3}
    assert workdir_lib.config_differences(changed, record) != []


def test_two_level_mesh_run_records_link_bytes_and_resumes(tmp_path):
    """--mesh=2x4: the ("node", "local") mesh, its bytes per link class, a resumable workdir."""
    from experiments import cli, main  # noqa: PLC0415

    argv = ["main", "--mesh=2x4", "--compressor=top_k", "--ratio=0.1", "--num_devices=8"]
    config = main.config_from_flags(cli.parse(main.define_flags, argv))
    assert config.mesh == "2x4" and train.data_axis(config) == ("node", "local")
    config = dataclasses.replace(
        TINY,
        mesh=config.mesh,
        compressor=config.compressor,
        compressor_kwargs=config.compressor_kwargs,
        num_devices=8,
        epochs=2,
        checkpoint=True,
        time_split=False,
    )
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    resumed = train.train_and_evaluate(config, str(tmp_path))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert resumed["records"][0] == first["records"][0]
    record = resumed["records"][-1]
    # Intra-node: reduce-scatter and all-gather, 2 (L - 1) / L of each leaf padded to L rows.
    sizes = [np.size(x) for x in jax.tree.leaves(resumed["params"])]
    padded = 4 * sum(-(-n // 4) * 4 for n in sizes)
    assert record["intra_node_bytes_per_step_per_device"] == pytest.approx(2 * 3 / 4 * padded)
    assert 0 < record["inter_node_bytes_per_step_per_device"] < padded
    assert record["bytes_per_step_per_device"] == pytest.approx(
        record["intra_node_bytes_per_step_per_device"]
        + record["inter_node_bytes_per_step_per_device"]
    )
    # Density of the node-mean gradient: each device's shard count times L.
    assert 0.1 <= record["density"] < 0.12
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert "inter_node_bytes_per_step_per_device" in json.loads(lines[-1])


def test_config_json_without_mesh_resumes_as_the_flat_mesh(tmp_path):
    config = dataclasses.replace(TINY, epochs=2, checkpoint=True, time_split=False)
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    path = tmp_path / train.CONFIG_FILE
    stored = json.loads(path.read_text())
    del stored["config"]["mesh"]  # written before the field existed
    path.write_text(json.dumps(stored))
    resumed = train.train_and_evaluate(config, str(tmp_path))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert resumed["records"][0] == first["records"][0]
    assert "intra_node_bytes_per_step_per_device" not in resumed["records"][-1]
    # The two-level mesh is another run.
    two_level = dataclasses.replace(config, mesh="1x2", epochs=3)
    with pytest.raises(train.WorkdirError, match="mesh=None there, '1x2' now"):
        train.train_and_evaluate(two_level, str(tmp_path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mesh": "2by4"}, "NODESxLOCAL"),
        ({"mesh": "3x3"}, "has 9 devices, the run 8"),
        ({"mesh": "2x4", "sampling": "feature"}, "sampling='feature'"),
        ({"mesh": "2x4", "exchange": "coded", "redundancy": 2}, "CSSGD"),
        ({"mesh": "2x4", "compressor": "onebit_lamb"}, "onebit_lamb"),
    ],
)
def test_bad_two_level_mesh_is_an_invalid_config(overrides, message):
    config = dataclasses.replace(TINY, num_devices=8, **overrides)
    with pytest.raises(train.ConfigError, match=message):
        train.validate_config(config, 8)


def test_server_group_run_splits_time_resumes_and_checks_servers(tmp_path, capsys):
    """--exchange=server --servers=2: a group of parameter servers, time split, resumable."""
    from experiments import cli, main  # noqa: PLC0415

    argv = ["main", "--compressor=top_k", "--ratio=0.1", "--exchange=server", "--servers=2"]
    flagged = main.config_from_flags(cli.parse(main.define_flags, argv))
    assert (flagged.exchange, flagged.servers) == ("server", 2)
    config = dataclasses.replace(
        TINY,
        compressor="top_k",
        compressor_kwargs={"ratio": 0.1, "granularity": "global"},
        exchange="server",
        servers=2,
        epochs=2,
        checkpoint=True,
    )
    first = train.train_and_evaluate(config, str(tmp_path), stop_after_epoch=1)
    resumed = train.train_and_evaluate(config, str(tmp_path))
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    assert resumed["records"][0] == first["records"][0]
    record = resumed["records"][-1]
    assert np.isfinite(record["train_loss"]) and record["time_step"] > 0
    assert record["time_communication"] >= 0 and (tmp_path / "time_split.png").exists()
    # A worker's link: the global selection's whole message to each of the 2 servers,
    # the dense pull of every parameter.
    n = sum(np.size(x) for x in jax.tree.leaves(resumed["params"]))
    cap = -(-3 * -(-n // 10) // 2)  # ceil(1.5 k), k = ceil(0.1 n)
    assert record["bytes_per_step_per_device"] == pytest.approx(2 * cap * 8 + n * 4)
    # One server is another run.
    with pytest.raises(train.WorkdirError, match="servers=2 there, 1 now"):
        train.train_and_evaluate(dataclasses.replace(config, servers=1), str(tmp_path))
    for args, message in [
        (["--exchange=server", "--servers=3", "--num_devices=2"], "servers (--servers) must"),
        (["--servers=2", "--num_devices=2"], "needs --exchange=server"),
    ]:
        with _logging_levels_kept(), pytest.raises(SystemExit):
            main.main(["main", f"--workdir={tmp_path / 'bad'}", "--compressor=top_k", *args])
        assert message in capsys.readouterr().err
