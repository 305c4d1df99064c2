"""The client: each call runs the ``batchfleet`` command with ``--json``
and reads its one JSON object; results are read from the output folder."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import signal
import subprocess
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _toml
from ._binary import binary
from .errors import BatchfleetError, error_for

if TYPE_CHECKING:  # pragma: no cover
    import pandas
    import pyarrow

PathLike = Union[str, "os.PathLike[str]"]
Manifest = Union[PathLike, Mapping[str, Any]]

_PART = re.compile(r"^part-(\d+)\.(csv|jsonl|parquet)$")
_REJECTS = re.compile(r"^part-(\d+)\.jsonl$")
# How long a command stopped by Ctrl-C gets to stop by itself (it stops its
# workers at their next checkpoint) before it is killed.
_STOP_GRACE_S = 30.0


class Job:
    """A batchfleet job: one that :func:`run` started, or one found by id
    with :func:`job`.

    ``id`` is the job id (``<name>-<8 hex>``). ``report`` is the job's
    summary once it has ended (``_summary.json``, a dict), else ``None``.
    """

    def __init__(
        self,
        job_id: str,
        *,
        output_dir: Optional[str] = None,
        report: Optional[Dict[str, Any]] = None,
        local: bool = False,
        env: Optional[Mapping[str, str]] = None,
    ) -> None:
        self.id = job_id
        self.report = report
        self.local = local
        self._output_dir = output_dir or (report or {}).get("output_dir")
        self._env = dict(env or {})

    def __repr__(self) -> str:
        state = self.report["status"] if self.report else "running"
        return f"Job({self.id!r}, {state}, output_dir={self._output_dir!r})"

    @property
    def output_dir(self) -> str:
        """The job's output folder (a local path or an ``s3://`` prefix)."""
        if self._output_dir is None:
            self._output_dir = str(self.status()["output_dir"])
        return self._output_dir

    def wait(self, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Follows the job to its end (``batchfleet wait``) and returns its
        summary. Raises :class:`~batchfleet.JobFailed` (or another error
        named for the exit code) if it did not complete, and
        :class:`TimeoutError` after ``timeout`` seconds (the job carries on)."""
        if self.report is None:
            out = _call(["wait", self.id], self._env, timeout=timeout, what=f"job {self.id}")
            self.report = out.get("report")
            self._output_dir = self._output_dir or (self.report or {}).get("output_dir")
        return self.report or {}

    def status(self) -> Dict[str, Any]:
        """The job's progress (``batchfleet status --json``): its record
        (``status``, ``items_total``, ``items_done``, ``rows_done``,
        ``output_dir`` …) with ``percent_done``, ``rows_per_s``,
        ``elapsed_s``, ``eta_s``, ``in_flight``, ``workers`` …. A ``--local``
        job has no state in Redis: its summary instead."""
        if self.local:
            return self.summary()
        return _call(["status", self.id], self._env, what=f"job {self.id}")

    def cancel(self, reason: Optional[str] = None) -> Dict[str, Any]:
        """Cancels the job (``batchfleet cancel``): queued items are skipped,
        in-flight ones stop at their next checkpoint, committed ones stay.
        Returns what the command says (``cancelled``, ``status``)."""
        args = ["cancel", self.id]
        if reason:
            args += ["--reason", reason]
        return _call(args, self._env, what=f"job {self.id}")

    def summary(self) -> Dict[str, Any]:
        """The job's ``_summary.json``, read from its output folder (written
        when the job ends: rows, items, failures with reasons, latency,
        prediction histograms, lineage)."""
        fs, root = _filesystem(self.output_dir)
        names = set(_list(fs, root))
        name = "_summary.json" if "_summary.json" in names or "summary.json" not in names else "summary.json"
        try:
            with fs.open_input_stream(_join(root, name)) as f:
                return json.loads(f.read())
        except FileNotFoundError:
            raise BatchfleetError(f"{_join(self.output_dir, name)} does not exist: job {self.id} has not ended yet (Job.wait() waits for it)", job_id=self.id) from None

    def to_arrow(self, reused: bool = False) -> "pyarrow.Table":
        """Every predicted row, in input order, as one ``pyarrow.Table``
        (the part files ``part-*`` of the output folder, in item order).

        ``reused=True``, for a job run with ``--since``: also the rows of the
        files it reused, from the parts of the folders its summary names
        (``incremental.reused``), after its own."""
        import pyarrow as pa

        text_columns = self._text_columns()
        tables = _read_parts(self.output_dir, text_columns)
        if reused:
            for r in (self.summary().get("incremental") or {}).get("reused", []):
                if not r.get("items"):
                    raise BatchfleetError(f"{r['path']} was reused from {r['output_dir']}, whose summary does not say which parts hold it (a job from before batchfleet recorded that): read that folder yourself", job_id=self.id)
                first, last = r["items"]
                tables += _read_parts(r["output_dir"], text_columns, range(first, last + 1))
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables, promote_options="permissive")

    def to_pandas(self, reused: bool = False) -> "pandas.DataFrame":
        """:meth:`to_arrow` as a ``pandas.DataFrame``."""
        return self.to_arrow(reused=reused).to_pandas()

    def rejects(self) -> "pandas.DataFrame":
        """The rows that were not predicted, with why: one row per rejected
        input row, with ``item``, ``file``, ``line``, ``raw``, ``reason`` and
        ``stage`` (``parse``: the row could not be read; ``model``: the model
        raised on it). Empty when nothing was rejected."""
        import pandas as pd

        fs, root = _filesystem(self.output_dir)
        records: List[Dict[str, Any]] = []
        for folder in ("_rejects", "rejects"):
            here = _join(root, folder)
            for name in sorted(_list(fs, here)):
                m = _REJECTS.match(name)
                if not m:
                    continue
                with fs.open_input_stream(_join(here, name)) as f:
                    for line in f.read().decode("utf-8").splitlines():
                        if line.strip():
                            records.append({"item": int(m.group(1)), **json.loads(line)})
        columns = ["item", "file", "line", "raw", "reason", "stage"]
        frame = pd.DataFrame.from_records(records, columns=columns if not records else None)
        return frame[[c for c in columns if c in frame.columns] + [c for c in frame.columns if c not in columns]]

    def _text_columns(self) -> List[str]:
        """Columns a CSV part holds as text whatever they look like: the id,
        labels, and the input columns copied through."""
        names = ["id", "label"] + [f"top{k}_label" for k in range(1, 1001)]
        try:
            manifest = self.summary().get("resolved_manifest") or {}
            names += list((manifest.get("output") or {}).get("include_columns") or [])
        except BatchfleetError:
            pass
        return names


def run(
    manifest: Manifest,
    *,
    set: Optional[Union[Mapping[str, Any], Iterable[str]]] = None,
    since: Optional[str] = None,
    local: bool = False,
    detach: bool = False,
    data_roots: Optional[Sequence[PathLike]] = None,
    workers: Optional[int] = None,
    env: Optional[Mapping[str, str]] = None,
    timeout: Optional[float] = None,
) -> Optional[Job]:
    """Runs a job (``batchfleet run``) and returns it.

    ``since`` (a finished job's id, output folder or ``_summary.json``)
    scores only the input files new or changed since that job
    (``--since``); with nothing new or changed nothing runs and this
    returns ``None``. :meth:`Job.to_pandas` with ``reused=True`` then
    reads the reused files' rows too.

    ``manifest`` is the path of a manifest, or a dict of one (its tables as
    nested dicts), written as TOML to ``.batchfleet/<name>-<digest>.toml``
    in the current folder: relative paths in it are relative to the current
    folder, and the file stays for ``dlq replay`` to read again.

    ``set`` overrides manifest values (``{"batching.item_rows": 5000}`` or
    ``["batching.item_rows=5000"]``, as ``--set``). ``local=True`` runs the
    job in this machine's own processes, with no RabbitMQ or Redis
    (``workers`` of them). ``detach=True`` returns as soon as the items are
    published (then :meth:`Job.wait`); otherwise this returns when the job
    has ended, and raises :class:`~batchfleet.ManifestError`,
    :class:`~batchfleet.JobFailed`, :class:`~batchfleet.JobCancelled` … if
    it did not complete. ``data_roots`` are the folders the job's files may
    lie under (``--data-root``); ``env`` adds environment variables
    (``BATCHFLEET_AMQP_URL``, ``BATCHFLEET_REDIS_URL`` …) to the command's.
    """
    if local and detach:
        raise ValueError("a --local run runs in this process and cannot be detached")
    args = ["run", _manifest_path(manifest)]
    if local:
        args.append("--local")
        if workers is not None:
            args += ["--workers", str(workers)]
    elif workers is not None:
        raise ValueError("workers= is for local=True; a fleet's workers are started apart (batchfleet-worker)")
    if detach:
        args.append("--detach")
    for root in data_roots or ():
        args += ["--data-root", os.fspath(root)]
    for kv in _overrides(set):
        args += ["--set", kv]
    if since is not None:
        args += ["--since", os.fspath(since)]
    out = _call(args, env or {}, timeout=timeout, what="batchfleet run")
    if out.get("status") == "nothing_to_score":
        return None
    report = out.get("report")
    output_dir = (report or {}).get("output_dir")
    if output_dir is None and out.get("summary"):
        output_dir = os.path.dirname(str(out["summary"]))
    return Job(out["job_id"], output_dir=output_dir, report=report, local=local, env=env)


def _read_parts(output_dir: str, text_columns: List[str], seqs: Optional[range] = None) -> List["pyarrow.Table"]:
    """The part files of ``output_dir`` (those of ``seqs`` only, if given), in item order."""
    fs, root = _filesystem(output_dir)
    parts = sorted(
        (int(m.group(1)), m.group(2), name)
        for name in _list(fs, root)
        if (m := _PART.match(name)) and (seqs is None or int(m.group(1)) in seqs)
    )
    return [_read_part(fs, _join(root, name), fmt, text_columns) for _, fmt, name in parts]


def job(job_id: str, *, env: Optional[Mapping[str, str]] = None) -> Job:
    """Attaches to a job by id (one ``batchfleet run --detach`` started, or
    another process): raises :class:`~batchfleet.BatchfleetError` if Redis
    does not know it."""
    status = _call(["status", job_id], env or {}, what=f"job {job_id}")
    return Job(job_id, output_dir=str(status["output_dir"]), env=env)


def _overrides(values: Optional[Union[Mapping[str, Any], Iterable[str]]]) -> List[str]:
    if values is None:
        return []
    if isinstance(values, Mapping):
        return [f"{k}={_override_value(v)}" for k, v in values.items()]
    if isinstance(values, str):
        return [values]
    return list(values)


def _override_value(v: Any) -> str:
    if isinstance(v, str):
        return v
    return _toml._value(v, [])


def _manifest_path(manifest: Manifest) -> str:
    if not isinstance(manifest, Mapping):
        return os.fspath(manifest)
    text = _toml.dumps(dict(manifest))
    name = str((manifest.get("job") or {}).get("name") or "job")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64]
    folder = os.path.abspath(".batchfleet")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.toml")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    return path


def _call(
    args: List[str],
    env: Mapping[str, str],
    *,
    timeout: Optional[float] = None,
    what: str,
) -> Dict[str, Any]:
    """Runs ``batchfleet <args> --json``; its JSON object, or the error
    named for its exit code."""
    cmd = [binary("batchfleet")] + args + ["--json"]
    full_env = dict(os.environ)
    full_env.update(env)
    # Progress bars are for terminals; its log lines go to stderr.
    full_env.setdefault("BATCHFLEET_NO_PROGRESS", "1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise TimeoutError(f"{what} did not end within {timeout} s (the job carries on)") from None
    except BaseException:
        _stop(proc)
        raise
    err = stderr.decode("utf-8", "replace")
    out = _last_json(stdout.decode("utf-8", "replace"))
    code = proc.returncode
    if code != 0 or out is None or out.get("status") == "error":
        if out is not None and isinstance(out.get("exit_code"), int):
            code = out["exit_code"] or code
        raise error_for(code)(
            _message(out, err, what, code),
            exit_code=code,
            job_id=(out or {}).get("job_id"),
            report=(out or {}).get("report"),
            stderr=err,
        )
    return out


def _stop(proc: "subprocess.Popen[bytes]") -> None:
    """Stops a command as Ctrl-C would, then for good."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=_STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _last_json(text: str) -> Optional[Dict[str, Any]]:
    text = text.strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
        for line in reversed(text.splitlines()):
            try:
                value = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    return value if isinstance(value, dict) else None


def _message(out: Optional[Dict[str, Any]], stderr: str, what: str, code: int) -> str:
    if out is not None and out.get("error"):
        return str(out["error"])
    report = (out or {}).get("report") or {}
    if report:
        text = f"job {report.get('job_id')} {report.get('status')}"
        if report.get("failed_reason"):
            text += f": {report['failed_reason']}"
        failed = report.get("failed_items") or []
        for f in failed[:5]:
            text += f"\n  item {f.get('seq')} [{f.get('class')}]: {f.get('reason')}"
        if len(failed) > 5:
            text += f"\n  … and {len(failed) - 5} more in _summary.json"
        return text
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error")]
    tail = "\n".join((errors or lines)[-5:])
    return tail or f"{what}: batchfleet exited with code {code}"


def _filesystem(output_dir: str) -> Tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in output_dir:
        return pafs.FileSystem.from_uri(output_dir)
    return pafs.LocalFileSystem(), os.path.abspath(output_dir)


def _join(root: str, name: str) -> str:
    return root.rstrip("/") + "/" + name


def _list(fs: Any, folder: str) -> List[str]:
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    except FileNotFoundError:
        return []
    return [i.base_name for i in infos]


def _read_part(fs: Any, path: str, fmt: str, text_columns: List[str]) -> "pyarrow.Table":
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, filesystem=fs)
    with fs.open_input_stream(path) as f:
        data = f.read()
    import pyarrow as pa

    if fmt == "csv":
        import pyarrow.csv as pcsv

        header = data.split(b"\n", 1)[0].decode("utf-8")
        names = next(csv.reader([header]), [])
        types = {c: pa.string() for c in names if c in text_columns}
        return pcsv.read_csv(pa.BufferReader(data), convert_options=pcsv.ConvertOptions(column_types=types, strings_can_be_null=False))
    import pyarrow.json as pjson

    return pjson.read_json(pa.BufferReader(data))
