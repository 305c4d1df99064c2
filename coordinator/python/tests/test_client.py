"""The Python client against the real batchfleet: jobs run --local and on a
fleet of real workers (RabbitMQ, Redis, libtorch), their output read back
with the client, pandas, pyarrow and DuckDB and checked row by row against
PyTorch's own predictions."""

from __future__ import annotations

import glob
import math
import os
import tomllib

import duckdb
import pandas as pd
import pyarrow.dataset as pads
import pytest

import batchfleet
from batchfleet import _toml
from conftest import make_job


def assert_predictions(frame: pd.DataFrame, golden, *, what: str) -> None:
    """Every golden row exactly once, with PyTorch's score."""
    ids = frame["id"].astype(str).tolist()
    assert len(ids) == len(set(ids)), f"{what}: an id appears twice"
    assert set(ids) == set(golden), f"{what}: {len(set(golden) - set(ids))} ids missing, {len(set(ids) - set(golden))} unexpected"
    for i, score in zip(ids, frame["score"].tolist()):
        want = golden[i][0]
        assert math.isclose(score, want, rel_tol=1e-5, abs_tol=1e-5), f"{what}: id {i}: {score} != {want}"


def manifest_of(folder: str) -> dict:
    with open(os.path.join(folder, "job.toml"), "rb") as f:
        m = tomllib.load(f)
    # A dict manifest's relative paths are relative to the current folder.
    m["input"]["paths"] = [os.path.join(folder, p) for p in m["input"]["paths"]]
    m["model"]["path"] = os.path.join(folder, m["model"]["path"])
    m["output"]["dir"] = os.path.join(folder, "out")
    return m


def add_bad_row(folder: str) -> None:
    """A row whose first feature is not a number: rejected, not predicted."""
    first = sorted(glob.glob(os.path.join(folder, "data", "*.csv")))[0]
    with open(first) as f:
        width = len(f.readline().rstrip("\n").split(","))
    with open(first, "a") as f:
        f.write("bad-row," + ",".join(["abc"] + ["1"] * (width - 2)) + "\n")


def test_a_local_job_reads_back_as_one_dataset_with_every_reader(tmp_path) -> None:
    folder = str(tmp_path)
    golden = make_job(folder, rows=3000, item_rows=400)
    add_bad_row(folder)
    job = batchfleet.run(
        os.path.join(folder, "job.toml"),
        local=True,
        workers=2,
        set={"output.format": "parquet", "output.merge": True},
        data_roots=[folder],
    )
    out = job.output_dir
    # Beside the parts: the summary, the rejects, the merged file, the markers.
    names = set(os.listdir(out))
    assert {"_summary.json", "_rejects", "_merged", "_SUCCESS", "_JOB"} <= names, names
    assert all(n.startswith("part-") or n.startswith("_") for n in names), names
    assert job.report["rows_predicted"] == 3000 and job.report["rows_rejected"] == 1

    assert_predictions(job.to_pandas(), golden, what="Job.to_pandas")
    assert job.to_arrow().num_rows == 3000
    assert_predictions(pd.read_parquet(out), golden, what="pandas.read_parquet(out)")
    assert_predictions(pads.dataset(out, format="parquet").to_table().to_pandas(), golden, what="pyarrow.dataset")
    assert_predictions(duckdb.sql(f"SELECT * FROM read_parquet('{out}/*.parquet')").df(), golden, what="duckdb")
    merged = pd.read_parquet(os.path.join(out, "_merged", "predictions.parquet"))
    assert_predictions(merged, golden, what="the merged file")
    # In input order: the merged file's ids are to_pandas()'s.
    assert merged["id"].tolist() == job.to_pandas()["id"].tolist()

    rejects = job.rejects()
    assert len(rejects) == 1, rejects
    row = rejects.iloc[0]
    assert row["raw"].startswith("bad-row,abc") and row["stage"] == "parse" and '"abc"' in row["reason"], row.to_dict()
    summary = job.summary()
    assert summary["job_id"] == job.id and summary["status"] == "completed"


def test_an_incremental_job_scores_the_new_file_and_reads_back_with_what_it_reused(tmp_path) -> None:
    folder = str(tmp_path)
    make_job(folder, rows=1000, item_rows=250)
    manifest = os.path.join(folder, "job.toml")
    first = batchfleet.run(manifest, local=True, workers=1, data_roots=[folder])
    data = os.path.join(folder, "data")
    existing = sorted(os.listdir(data))
    with open(os.path.join(data, existing[0])) as src, open(os.path.join(data, "zz-new.csv"), "w") as dst:
        lines = src.read().splitlines()
        dst.write("\n".join([lines[0]] + [f"new-{i}," + l.split(",", 1)[1] for i, l in enumerate(lines[1:])]) + "\n")
    new_rows = len(lines) - 1
    later = batchfleet.run(manifest, local=True, workers=1, data_roots=[folder],
                           set={"output.dir": os.path.join(folder, "out-2")}, since=first.output_dir)
    assert later is not None and later.id != first.id
    assert len(later.to_pandas()) == new_rows
    every = later.to_pandas(reused=True)
    assert len(every) == 1000 + new_rows
    assert sorted(every["id"]) == sorted(list(first.to_pandas()["id"]) + [f"new-{i}" for i in range(new_rows)])
    # Nothing new since the second: nothing runs.
    assert batchfleet.run(manifest, local=True, workers=1, data_roots=[folder],
                          set={"output.dir": os.path.join(folder, "out-3")}, since=later.output_dir) is None


def test_csv_and_jsonl_outputs_read_back_with_pandas(tmp_path) -> None:
    folder = str(tmp_path)
    golden = make_job(folder, rows=1200, item_rows=300)
    add_bad_row(folder)
    csv_job = batchfleet.run(os.path.join(folder, "job.toml"), local=True, set=["output.merge=true"], data_roots=[folder])
    parts = sorted(glob.glob(os.path.join(csv_job.output_dir, "part-*.csv")))
    frame = pd.concat([pd.read_csv(p, dtype={"id": str}) for p in parts])
    assert_predictions(frame, golden, what="pandas.read_csv over the parts")
    assert_predictions(csv_job.to_pandas(), golden, what="Job.to_pandas (csv)")
    assert pd.api.types.is_string_dtype(csv_job.to_pandas()["id"])  # ids stay text

    jsonl_job = batchfleet.run(
        os.path.join(folder, "job.toml"),
        local=True,
        set={"output.format": "jsonl", "output.dir": os.path.join(folder, "out-jsonl")},
        data_roots=[folder],
    )
    assert_predictions(jsonl_job.to_pandas(), golden, what="Job.to_pandas (jsonl)")
    assert len(jsonl_job.rejects()) == 1


def test_a_fleet_job_from_a_dict_detached_waited_and_attached(fleet, tmp_path, monkeypatch) -> None:
    folder = str(tmp_path)
    monkeypatch.chdir(tmp_path)  # where the dict's TOML is written (.batchfleet/)
    golden = make_job(folder, rows=4000, item_rows=500, fmt="parquet")
    fleet.start(2)
    manifest = manifest_of(folder)
    manifest["job"]["pool"] = fleet.pool
    manifest["output"]["format"] = "parquet"
    job = batchfleet.run(manifest, detach=True, env=fleet.env, data_roots=[folder])
    assert job.report is None
    report = job.wait(timeout=180)
    assert report["status"] == "completed" and report["rows_predicted"] == 4000
    assert_predictions(job.to_pandas(), golden, what="a fleet job's Job.to_pandas")
    assert_predictions(pd.read_parquet(job.output_dir), golden, what="a fleet job's pandas.read_parquet")

    attached = batchfleet.job(job.id, env=fleet.env)
    status = attached.status()
    assert status["status"] == "completed" and status["output_dir"] == job.output_dir
    assert attached.summary()["rows_predicted"] == 4000
    # The dict was written where the summary names it, for a replay to read.
    assert report["manifest"].startswith(os.path.join(folder, ".batchfleet") + os.sep)
    assert tomllib.load(open(report["manifest"], "rb"))["job"]["pool"] == fleet.pool

    # The same manifest again: the same job, already complete.
    again = batchfleet.run(manifest, env=fleet.env, data_roots=[folder])
    assert again.id == job.id


def test_a_cancelled_job_raises_job_cancelled(services, fleet, tmp_path) -> None:
    folder = str(tmp_path)
    make_job(folder, rows=2000, item_rows=100)
    # No worker serves this pool: the items wait in the queue.
    job = batchfleet.run(
        os.path.join(folder, "job.toml"), detach=True, env=fleet.env, set={"job.pool": fleet.pool}, data_roots=[folder]
    )
    assert job.status()["status"] == "running"
    said = job.cancel(reason="changed my mind")
    assert said["cancelled"] is True
    with pytest.raises(batchfleet.JobCancelled) as e:
        job.wait(timeout=60)
    assert e.value.exit_code == 6 and e.value.job_id == job.id and e.value.report["status"] == "cancelled"


def test_an_invalid_manifest_raises_manifest_error_naming_the_field(tmp_path, monkeypatch) -> None:
    folder = str(tmp_path)
    monkeypatch.chdir(tmp_path)
    make_job(folder, rows=100)
    manifest = manifest_of(folder)
    manifest["input"]["feature_columns"] = ["f0", "no_such_column"]
    with pytest.raises(batchfleet.ManifestError) as e:
        batchfleet.run(manifest, local=True, data_roots=[folder])
    assert e.value.exit_code == 2
    assert "no_such_column" in e.value.message, e.value.message
    assert not os.path.exists(os.path.join(folder, "out")) or not glob.glob(os.path.join(folder, "out", "part-*"))


def test_a_job_with_failed_items_raises_job_failed_with_its_report(tmp_path) -> None:
    folder = str(tmp_path)
    make_job(folder, rows=1000, item_rows=250, files=1)
    add_bad_row(folder)
    with pytest.raises(batchfleet.JobFailed) as e:
        batchfleet.run(
            os.path.join(folder, "job.toml"),
            local=True,
            set={"failure.on_bad_row": "fail_item", "failure.max_failed_items": 5},
            data_roots=[folder],
        )
    err = e.value
    assert isinstance(err, batchfleet.ItemsFailed) and err.exit_code == 3, (type(err), err.exit_code, err.message)
    assert err.report["items_failed"] == 1 and err.report["failed_items"][0]["class"] == "poison"
    assert "poison" in err.message


def test_the_toml_writer_round_trips_a_manifest() -> None:
    doc = {
        "job": {"name": "q\"uoted ü", "pool": "p"},
        "input": {"format": "csv", "paths": ["a/*.csv", "b.csv"], "missing": 0.5},
        "output": {"dir": "out", "merge": True, "histogram": {"min": -1.0, "max": 1e9, "bins": 20}},
        "model": {"path": "m.pt", "shadow": {"path": "s.pt"}},
        "on_complete": [{"command": ["echo", "a"]}, {"webhook": "https://x/y"}],
    }
    assert tomllib.loads(_toml.dumps(doc)) == doc
    with pytest.raises(TypeError, match="model.path"):
        _toml.dumps({"model": {"path": object()}})
