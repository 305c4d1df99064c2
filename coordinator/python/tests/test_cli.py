"""The command line's editor and manual support: `batchfleet schema` (the
manifest's JSON Schema, checked here with a validator as editors use it)
and `batchfleet man` (the manual pages `make dist` ships)."""

from __future__ import annotations

import copy
import glob
import json
import os
import subprocess
import tomllib

import jsonschema
import pytest

from conftest import ROOT


def batchfleet(*args: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.environ["BATCHFLEET_BIN_DIR"], "batchfleet")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    out = batchfleet("schema")
    assert out.returncode == 0, out.stderr
    schema = json.loads(out.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def examples() -> list[str]:
    found = sorted(glob.glob(os.path.join(ROOT, "docs", "examples", "*.toml")))
    assert len(found) >= 5, found
    return found


def test_every_documented_manifest_passes_the_schema(validator) -> None:
    for path in examples():
        with open(path, "rb") as f:
            manifest = tomllib.load(f)
        errors = [e.message for e in validator.iter_errors(manifest)]
        assert errors == [], f"{path}: {errors}"


def test_the_schema_refuses_what_the_parser_refuses(validator) -> None:
    with open(os.path.join(ROOT, "docs", "examples", "parquet.toml"), "rb") as f:
        good = tomllib.load(f)
    assert validator.is_valid(good)

    def broken(change) -> list[str]:
        manifest = copy.deepcopy(good)
        change(manifest)
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]

    misspelt = broken(lambda m: m["model"].update(pathh="x.pt"))
    assert any("pathh" in e for e in misspelt), misspelt
    assert any("pathh" in e for e in broken(lambda m: m["batching"].update(pathh=1) if "batching" in m else m.update(batching={"pathh": 1})))
    assert any(e.startswith("input/format") for e in broken(lambda m: m["input"].update(format="xlsx")))
    assert any(e.startswith("batching/item_rows") for e in broken(lambda m: m.setdefault("batching", {}).update(item_rows="ten")))
    assert any("output" in e for e in broken(lambda m: m.pop("output")))
    assert any("[job]" in e or "job" in e for e in broken(lambda m: m.update(jobb={})))
    # A section's description reaches the editor's hover.
    hover = validator.schema["$defs"]["FailureSection"]["properties"]["max_crashes"]["description"]
    assert "crash" in hover


def test_man_writes_a_page_per_command_with_every_flag(tmp_path) -> None:
    out = batchfleet("man", str(tmp_path / "man1"))
    assert out.returncode == 0, out.stderr
    pages = sorted(os.listdir(tmp_path / "man1"))
    for page in ["batchfleet.1", "batchfleet-run.1", "batchfleet-plan.1", "batchfleet-dlq-replay.1", "batchfleet-schema.1", "batchfleet-worker.1"]:
        assert page in pages, pages
    run = (tmp_path / "man1" / "batchfleet-run.1").read_text()
    assert run.startswith(".ie") or ".TH" in run, run[:200]
    assert "data\\-root" in run and "BATCHFLEET_DATA_ROOT" in run
    worker = (tmp_path / "man1" / "batchfleet-worker.1").read_text()
    for flag in ["outage\\-timeout", "connect\\-timeout", "cache\\-dir"]:
        assert flag in worker, flag
    assert "BATCHFLEET_OUTAGE_TIMEOUT" in worker


def test_validation_names_a_model_written_by_a_newer_torch(tmp_path) -> None:
    """A TorchScript archive whose format version is newer than this
    libtorch reads: validation warns with the version to save it with,
    before its trial of the model finds that libtorch cannot load it."""
    import zipfile

    from conftest import make_job

    folder = str(tmp_path)
    make_job(folder, rows=50, files=1)
    model = os.path.join(folder, "model.pt")
    rewritten = os.path.join(folder, "newer.pt")
    with zipfile.ZipFile(model) as src, zipfile.ZipFile(rewritten, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/version"):
                data = b"11\n"
            dst.writestr(info, data)
    os.replace(rewritten, model)
    out = batchfleet("plan", "--local", "--data-root", folder, os.path.join(folder, "job.toml"))
    warning = "TorchScript archive of format version 11, newer than libtorch 2.13.0 reads"
    assert warning in out.stderr and "save it again with torch==2.13.0" in out.stderr, out.stderr
    assert out.stderr.index(warning) < out.stderr.index("maximum supported version for reading is 10"), out.stderr
    # The model as saved says nothing against this libtorch.
    os.remove(model)
    make_job(folder, rows=50, files=1)
    out = batchfleet("plan", "--local", "--data-root", folder, os.path.join(folder, "job.toml"))
    assert out.returncode == 0 and "format version" not in out.stderr, out.stderr
