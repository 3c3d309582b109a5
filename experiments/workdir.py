"""A run's workdir: ``config.json``, ``metrics.jsonl`` and the orbax checkpoints.

:func:`check_workdir` refuses (``WorkdirError``) a workdir holding another
configuration's run or other data before any training and writes
``config.json``; :func:`restore_checkpoint` resumes from the latest
checkpoint; :func:`read_records` and :func:`metrics_line` read and write the
strict-JSON metrics.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import jax
import numpy as np
from absl import logging

from experiments import jsonio
from experiments.config import (
    COMPRESSED_OPTIMIZERS,
    FLAT_KWARGS,
    TrainConfig,
    kwarg_name,
    resolve_config,
)

__all__ = [
    "CONFIG_FILE",
    "MERGE_PLAN_FILE",
    "RESUMABLE_FIELDS",
    "WorkdirError",
    "check_workdir",
    "checkpoint_manager",
    "config_differences",
    "config_record",
    "data_record",
    "metrics_line",
    "open_checkpoints",
    "read_records",
    "save_checkpoint",
    "start_metrics",
    "storable",
    "upgrade_record",
    "with_empty_leaves",
]

MERGE_PLAN_FILE = "merge_plan.json"


def checkpoint_manager(workdir: str):
    """``(orbax.checkpoint, a CheckpointManager of workdir/checkpoints keeping 2)``."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (only needed with checkpointing)

    return ocp, ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2),
    )


def metrics_line(record: dict) -> str:
    """``record`` as a line of strict JSON: a non-finite float (a diverged loss) as null.

    Python's ``json`` would write ``NaN``/``Infinity``, which is not JSON: ``jq``,
    JavaScript and other strict parsers reject the whole file.
    """
    return jsonio.dumps(record) + "\n"


def read_records(path: str, upto: int) -> list:
    """The records of ``metrics.jsonl`` up to epoch ``upto``; null read back as NaN.

    No field is null otherwise, so a resumed run's records hold the floats an
    uninterrupted run's would (NaN for any non-finite value); files written
    with a bare ``NaN`` still read.
    """
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [{k: math.nan if v is None else v for k, v in r.items()} for r in records]
        return [r for r in records if r["epoch"] <= upto]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WorkdirError(
            f"{path} is not a metrics file of this program ({e}){_OVERWRITE}"
        ) from None


class WorkdirError(ValueError):
    """The workdir holds a run this configuration must not resume or mix with."""


CONFIG_FILE = "config.json"
_CONFIG_FORMAT = 1
# Fields that change neither the trained parameters nor what the metrics
# mean: a run may resume with other values. ``epochs`` may also grow (to
# train longer, never shrink) when both schedules are "constant"; with "cosine" the
# schedule of the epochs already done depends on it.
RESUMABLE_FIELDS = (
    "progress",
    "checkpoint",
    "time_split",
    "time_compression",  # the name of time_split in config.json of older runs
    "data_dir",
    "download",
    "coordinator_address",
    "num_processes",
    "process_id",
    "fit_check_epochs",
)
_OVERWRITE = (
    "; use another --workdir, or pass --overwrite (train_and_evaluate(..., overwrite=True)) "
    "to delete its checkpoints and metrics"
)


def config_record(config: TrainConfig, num_devices: int) -> dict:
    """What ``config.json`` holds: the resolved config with the real device count."""
    fields = dataclasses.asdict(resolve_config(config))
    fields["num_devices"] = num_devices
    # As config.json holds it (tuples become lists), so that a stored
    # configuration compares equal to the one it was written from.
    return {"format": _CONFIG_FORMAT, "config": json.loads(json.dumps(fields))}


# Fields added after config.json existed whose default is not None: a
# config.json without them is a run that had this value.
_ADDED_FIELD_DEFAULTS = {
    "sampling": "global",
    "lr_milestones": [],
    "lr_decay": 0.1,
    "weight_decay": 0.0,
    "norm": "group",
    "augment": False,
}


def data_record(dataset) -> dict:
    """What identifies the data a run trains and tests on, for ``config.json``.

    ``data_dir`` may change on resuming (the same files moved), so the data
    themselves are recorded: their sizes, image shape and a cheap fingerprint
    (every label and 16 evenly spaced images of each split).
    """
    digest = hashlib.sha256()
    for x, y in ((dataset.train_x, dataset.train_y), (dataset.test_x, dataset.test_y)):
        picks = np.unique(np.linspace(0, len(y) - 1, 16).astype(np.int64))
        digest.update(np.ascontiguousarray(np.asarray(y, np.int64)).tobytes())
        digest.update(np.ascontiguousarray(np.asarray(x[picks], np.float32)).tobytes())
    return {
        "train_examples": len(dataset.train_y),
        "test_examples": len(dataset.test_y),
        "image_shape": [int(d) for d in dataset.train_x.shape[1:]],
        "num_classes": int(dataset.num_classes),
        "fingerprint": digest.hexdigest()[:16],
    }


def upgrade_record(fields: dict) -> dict:
    """A stored config record in today's form: flat compressor fields into ``compressor_kwargs``.

    Records written before ``compressor_kwargs`` hold the factory arguments as
    fields of their own (``ratio``, ``levels``, ``bits``, ``bucket_size``,
    ``rank``, ``freeze_step``, ...; :data:`experiments.config.FLAT_KWARGS`),
    None when unset, and name the ldte_bs paper's variant
    ``compressor="ldte_bs_paper"``. Their set values become the kwargs
    (``freeze_step`` is 0/1 Adam's ``var_freeze_step``) and
    ``ldte_bs_paper`` becomes ``ldte_bs`` with ``variant="paper"``: the same
    run as a resolved config of today, so the old workdir resumes.

    Example:
      >>> from experiments.workdir import upgrade_record
      >>> upgrade_record({"compressor": "qsgd", "levels": None, "bits": 4, "ratio": None})
      {'compressor': 'qsgd', 'compressor_kwargs': {'bits': 4}}
    """
    if "compressor_kwargs" in fields:
        return fields
    out = {k: v for k, v in fields.items() if k not in FLAT_KWARGS}
    compressor = fields.get("compressor")
    kwargs = {}
    if compressor == "ldte_bs_paper":
        compressor = out["compressor"] = "ldte_bs"
        kwargs["variant"] = "paper"
    for name in FLAT_KWARGS:
        if fields.get(name) is not None:
            kwargs[kwarg_name(compressor, name)] = fields[name]
    out["compressor_kwargs"] = kwargs
    return out


def config_differences(stored: dict, current: dict) -> list:
    """The fields of two config records that differ, ``"name=old there, new now"``.

    Both are read in today's form (:func:`upgrade_record`), so a record of
    flat compressor fields compares equal to its ``compressor_kwargs`` form.
    """
    stored, current = upgrade_record(stored), upgrade_record(current)
    kwargs = current.get("compressor_kwargs") or {}
    # A run under a constant schedule may be extended, unless something else
    # depends on the total: the compressed Adams' default freeze step (a fifth).
    extensible = stored.get("schedule") == current.get("schedule") == "constant" and not (
        current.get("compressor") in COMPRESSED_OPTIMIZERS
        and kwarg_name(current.get("compressor"), "freeze_step") not in kwargs
    )
    diffs = []
    for name in sorted(set(stored) | set(current)):
        if name in RESUMABLE_FIELDS or (name == "epochs" and extensible):
            continue
        # A field absent from an older config.json had its default (None unless listed).
        old = stored.get(name, _ADDED_FIELD_DEFAULTS.get(name))
        new = current.get(name, _ADDED_FIELD_DEFAULTS.get(name))
        if old != new:
            diffs.append(f"{name}={old!r} there, {new!r} now")
    return diffs


def _has_state(workdir: str) -> bool:
    """Whether ``workdir`` holds checkpoints or metrics a run could mix with its own."""
    ckpt = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        return True
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            return bool(f.read().strip())
    return False


def _clear_workdir(workdir: str) -> None:
    """Deletes what this program wrote in ``workdir`` (nothing else)."""
    import shutil  # noqa: PLC0415

    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    names = os.listdir(workdir) if os.path.isdir(workdir) else []
    written = [
        "metrics.jsonl",
        "accuracy.png",
        "time_split.png",
        CONFIG_FILE,
        MERGE_PLAN_FILE,
        "fit_check.json",
        *(n for n in names if re.fullmatch(r"fit_check_epoch\d+\.png", n)),
    ]
    for name in written:
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            os.remove(path)


def check_workdir(
    config: TrainConfig, workdir: str, num_devices: int, overwrite: bool, data: dict | None = None
) -> None:
    """Refuses a workdir holding another configuration's run; writes ``config.json``.

    Runs before any training, so a resumed run can only continue its own
    checkpoints and metrics. ``data`` (:func:`data_record`) is recorded and
    must match the stored record; a ``config.json`` without one (written
    before it was recorded) is accepted, its data unknown.
    """
    record = config_record(config, num_devices)
    if data is not None:
        record["data"] = data
    path = os.path.join(workdir, CONFIG_FILE)
    primary = jax.process_index() == 0
    if overwrite:
        if primary:
            _clear_workdir(workdir)
    elif _has_state(workdir):
        if not os.path.exists(path):
            raise WorkdirError(
                f"workdir {workdir} holds checkpoints or metrics but no {CONFIG_FILE} (written "
                f"by an older version, or not by this program), so they cannot be checked "
                f"against this configuration{_OVERWRITE}"
            )
        try:
            with open(path) as f:
                stored = json.load(f)
            fmt, stored_config = stored["format"], stored["config"]
            if not isinstance(stored_config, dict):
                raise TypeError("'config' is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise WorkdirError(
                f"{path} is not a valid run configuration ({e}){_OVERWRITE}"
            ) from None
        if fmt != _CONFIG_FORMAT:
            raise WorkdirError(
                f"{path} has format {fmt!r}, this program writes {_CONFIG_FORMAT}{_OVERWRITE}"
            )
        diffs = config_differences(stored_config, record["config"])
        if diffs:
            raise WorkdirError(
                f"workdir {workdir} holds a run with another configuration "
                f"({'; '.join(diffs)}), refusing to resume from it{_OVERWRITE}"
            )
        if not stored_config.get("checkpoint", True):
            # The run there saved no checkpoint: this one would start over and
            # truncate its metrics (finished or not) without a word.
            raise WorkdirError(
                f"workdir {workdir} holds a run with checkpoint=False (--checkpoint=false), "
                f"which left no checkpoint to resume from; a rerun would start over and "
                f"rewrite its metrics{_OVERWRITE}"
            )
        stored_epochs, epochs = stored_config.get("epochs"), record["config"]["epochs"]
        if isinstance(stored_epochs, int) and epochs < stored_epochs:
            # Only growing is resuming: a shrunk rerun would train nothing past
            # the epochs done and leave config.json claiming fewer than it holds.
            done = len(read_records(os.path.join(workdir, "metrics.jsonl"), math.inf))
            raise WorkdirError(
                f"workdir {workdir} holds a run of epochs={stored_epochs} ({done} done), "
                f"epochs={epochs} now: epochs may only grow (--epochs>={stored_epochs}) on "
                f"resuming{_OVERWRITE}"
            )
        stored_data = stored.get("data")
        if data is not None and isinstance(stored_data, dict):
            changed = [
                f"{k}={stored_data.get(k)!r} there, {v!r} now"
                for k, v in data.items()
                if stored_data.get(k) != v
            ]
            if changed:
                # data_dir may change on resuming, the data may not: the epochs
                # done and those to come would train (and test) on two datasets.
                raise WorkdirError(
                    f"workdir {workdir} holds a run on other data ({'; '.join(changed)}; "
                    f"--data_dir={config.data_dir!r} now), refusing to resume from it{_OVERWRITE}"
                )
        if not config.checkpoint:
            # Without checkpoints the run starts over: it would rewrite the
            # metrics of the run there, and a later resume would mix the two.
            raise WorkdirError(
                f"workdir {workdir} holds a run's checkpoints or metrics, and checkpoint=False "
                f"(--checkpoint=false) would start over and rewrite them{_OVERWRITE}"
            )
    if primary:
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    if jax.process_count() > 1:
        # The other processes must not list checkpoints while they are deleted.
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices("jaxcomp_check_workdir")


MERGE_PLAN_FILE = "merge_plan.json"


def storable(tree):
    """``tree`` with its zero-size leaves as None, for orbax.

    Orbax refuses to save an array of zero size ("Cannot save arrays with zero
    size"), and such a leaf holds nothing: 1-bit Adam's and 0/1 Adam's server
    error with the all-gather exchange, an empty parameter.
    """
    return jax.tree.map(lambda x: None if np.size(x) == 0 else x, tree)


def with_empty_leaves(restored, target):
    """``restored`` with ``target``'s zero-size leaves where :func:`storable` put None."""
    return jax.tree.map(
        lambda r, t: t if r is None else r, restored, target, is_leaf=lambda x: x is None
    )


def open_checkpoints(workdir: str, target: dict):
    """``(manager, restored)``: the workdir's checkpoints, and the latest restored onto ``target``.

    ``target`` is ``{"params", "opt_state", "epoch"[, "model_state"]}`` of
    this run (the shapes and shardings to restore to); ``restored`` is None
    without a checkpoint. Raises ``WorkdirError`` for a directory orbax
    cannot read or a checkpoint that does not restore onto ``target``.
    """
    try:
        ocp, manager = checkpoint_manager(workdir)
        latest = manager.latest_step()
    except Exception as e:  # noqa: BLE001 (an unreadable directory, whatever orbax says)
        raise WorkdirError(
            f"cannot read the checkpoints in {os.path.join(workdir, 'checkpoints')} "
            f"({type(e).__name__}: {e}){_OVERWRITE}"
        ) from None
    if latest is None:
        return manager, None
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, storable(target))
    try:
        restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
        restored = with_empty_leaves(restored, target)
    except Exception as e:  # noqa: BLE001 (any orbax failure means the same here)
        manager.close()
        cause = (str(e).strip().splitlines() or [""])[0][:300]
        raise WorkdirError(
            f"cannot restore the epoch-{latest} checkpoint in "
            f"{os.path.join(workdir, 'checkpoints')}: it is corrupted or its structure "
            f"does not match this configuration's parameters and optimizer state "
            f"({type(e).__name__}: {cause}){_OVERWRITE}"
        ) from None
    logging.info("resumed from %s at epoch %d", workdir, int(restored["epoch"]))
    return manager, restored


def save_checkpoint(manager, state: dict, epoch: int) -> None:
    """Saves ``state`` (``target`` of :func:`open_checkpoints`, no epoch) as ``epoch``'s."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (only needed with checkpointing)

    state = {**state, "epoch": np.asarray(epoch, np.int32)}
    manager.save(epoch, args=ocp.args.StandardSave(storable(state)))
    manager.wait_until_finished()


def start_metrics(path: str, start_epoch: int) -> list:
    """The records of the epochs done (to ``start_epoch``); ``path`` keeps only them."""
    records = read_records(path, start_epoch)
    if jax.process_index() == 0:
        with open(path, "w") as f:  # drop lines of epochs the checkpoint lacks
            f.writelines(metrics_line(r) for r in records)
    return records
