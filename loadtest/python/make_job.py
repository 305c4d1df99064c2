#!/usr/bin/env python3
"""Generate a batchfleet job: CSV, JSON Lines or Parquet input files, a TorchScript MLP, golden predictions and a manifest.

The golden file holds what PyTorch itself computes for every row, from the
same text the input files contain, so a batchfleet run can be checked row by row.

    python make_job.py --out DIR [--rows N] [--files K] [--features F]
                       [--hidden H] [--outputs O] [--seed S] [--name NAME] [--pool POOL]
                       [--item-rows N] [--batch-size B] [--checkpoint-every K]
                       [--format csv|jsonl|parquet|pandas] [--row-group-rows N]
                       [--missing-every K]

Writes DIR/data/part-XX.csv (header: id,f0..f{F-1}), DIR/data/part-XX.jsonl
(one object per line: "id" and "f0".."f{F-1}" as JSON numbers) or
DIR/data/part-XX.parquet (columns id (string), f0..f{F-1} (even ones float64,
odd ones float32) and an unused "note" string column; row groups of
--row-group-rows rows, default a quarter of --item-rows), DIR/model.pt,
DIR/classes.pt (the same model returning int64 classes: score > 0),
DIR/golden.csv (id plus score or score_0..), DIR/job.toml (output to DIR/out).

--format pandas writes CSV the way its users do: a float64 DataFrame
(columns id, f0..) saved with `DataFrame.to_csv(path)` and its defaults —
the index as an unnamed first column, floats at full precision (up to 17
significant digits), NaN as an empty field. --missing-every K makes every
K-th feature value NaN (in any format) and sets `[input] missing = 0` in the
manifest; the golden predictions then take those values as 0.
"""
import argparse
import csv
import json
import os

import torch


class Mlp(torch.nn.Module):
    def __init__(self, features: int, hidden: int, outputs: int):
        super().__init__()
        self.l1 = torch.nn.Linear(features, hidden)
        self.l2 = torch.nn.Linear(hidden, hidden)
        self.l3 = torch.nn.Linear(hidden, outputs)
        self.outputs = outputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h = torch.relu(self.l2(h))
        # Raw scores (no squashing), so that a wrong feature order or a lost
        # row shows up far above the comparison tolerance.
        y = self.l3(h) * 4.0
        if self.outputs == 1:
            return y.squeeze(1)
        return y


class Positive(torch.nn.Module):
    """The same model's outputs as integer classes: 1 where the score is above 0."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.inner(x) > 0).to(torch.int64)


def score_columns(outputs: int):
    return ["score"] if outputs == 1 else [f"score_{i}" for i in range(outputs)]


def write_parquet(path, header, ids, text, row_group_rows):
    """The same values as the CSV text, as numbers (float(text), then float32 for odd columns; "nan" as null)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"id": pa.array(ids, type=pa.string())}
    for j, name in enumerate(header[1:]):
        values = [None if row[j] == "nan" else float(row[j]) for row in text]
        columns[name] = pa.array(values, type=pa.float32() if j % 2 else pa.float64())
    columns["note"] = pa.array([f"not read {i}" for i in ids], type=pa.string())
    pq.write_table(pa.table(columns), path, row_group_size=row_group_rows, compression="snappy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--outputs", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--name", default="demo")
    ap.add_argument("--pool", default="default")
    ap.add_argument("--item-rows", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--poison-rows", default="", help="global row numbers whose f0 becomes -999 (make_faulty_models.py's poison sentinel)")
    ap.add_argument("--hang-rows", default="", help="global row numbers whose f0 becomes -777 (the hang sentinel)")
    ap.add_argument("--checkpoint-every", type=int, default=None, help="[batching] checkpoint_every in the manifest (default: unset)")
    ap.add_argument("--format", choices=["csv", "jsonl", "parquet", "pandas"], default="csv", help="input file format (pandas: CSV by DataFrame.to_csv)")
    ap.add_argument("--missing-every", type=int, default=0, help="make every K-th feature value missing (NaN / null) and set [input] missing = 0")
    ap.add_argument("--row-group-rows", type=int, default=None, help="Parquet row group size (default: item rows / 4)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    os.makedirs(os.path.join(args.out, "data"), exist_ok=True)

    model = torch.jit.script(Mlp(args.features, args.hidden, args.outputs).eval())
    model_path = os.path.join(args.out, "model.pt")
    torch.jit.save(model, model_path)
    torch.jit.save(torch.jit.script(Positive(model)), os.path.join(args.out, "classes.pt"))

    sentinels = {int(r): "-999.000000" for r in args.poison_rows.split(",") if r}
    sentinels.update({int(r): "-777.000000" for r in args.hang_rows.split(",") if r})
    header = ["id"] + [f"f{i}" for i in range(args.features)]
    golden_rows = []
    per_file = [args.rows // args.files + (1 if i < args.rows % args.files else 0) for i in range(args.files)]
    next_id = 0
    missing_count = 0
    for f, n in enumerate(per_file):
        ids = [f"r{next_id + i:08d}" for i in range(n)]
        first, next_id = next_id, next_id + n
        # Which values are missing: every K-th of the job's values, row-major.
        flat = (torch.arange(first, first + n, dtype=torch.int64).unsqueeze(1) * args.features
                + torch.arange(args.features)).reshape(n, args.features)
        missing = (flat % args.missing_every == 0) if args.missing_every else torch.zeros(n, args.features, dtype=torch.bool)
        missing_count += int(missing.sum())
        if args.format == "pandas":
            import pandas as pd

            # Full float64 values, as a DataFrame holds them (vectorized: to_csv
            # writes each as the shortest text that reads back to it).
            values = torch.rand(n, args.features, dtype=torch.float64) * 4 - 2
            for r in range(n):
                if first + r in sentinels:
                    values[r, 0] = float(sentinels[first + r])
            values[missing] = float("nan")
            frame = pd.DataFrame(values.numpy(), columns=header[1:])
            frame.insert(0, "id", ids)
            frame.to_csv(os.path.join(args.out, "data", f"part-{f:02d}.csv"))
            # Predict from the frame's values, rounded to float32 as torch.tensor does.
            x = torch.nan_to_num(values, nan=0.0).to(torch.float32)
            if n:
                with torch.no_grad():
                    y = model(x)
                golden_rows.extend(zip(ids, y.reshape(n, -1).tolist()))
            continue
        feats = (torch.rand(n, args.features) * 4 - 2).tolist()
        text = [[f"{v:.6f}" for v in row] for row in feats]
        for r in range(n):
            if first + r in sentinels:
                text[r][0] = sentinels[first + r]
        for r, j in missing.nonzero().tolist():
            text[r][j] = "nan"
        if args.format == "parquet":
            write_parquet(os.path.join(args.out, "data", f"part-{f:02d}.parquet"), header, ids, text,
                          args.row_group_rows or max(1, args.item_rows // 4))
        elif args.format == "jsonl":
            with open(os.path.join(args.out, "data", f"part-{f:02d}.jsonl"), "w") as fh:
                for i, row in zip(ids, text):
                    # The numbers' text verbatim, as JSON numbers (NaN as null).
                    fields = [f"{json.dumps(k)}: {'null' if v == 'nan' else v}" for k, v in zip(header[1:], row)]
                    fh.write("{" + ", ".join([f'"id": {json.dumps(i)}'] + fields) + "}\n")
        else:
            with open(os.path.join(args.out, "data", f"part-{f:02d}.csv"), "w", newline="") as fh:
                w = csv.writer(fh, lineterminator="\n")
                w.writerow(header)
                for i, row in zip(ids, text):
                    w.writerow([i] + row)
        if n == 0:
            continue
        # Predict from the very text written, parsed the way a reader would.
        x = torch.tensor([[float(v) for v in row] for row in text], dtype=torch.float32)
        x = torch.nan_to_num(x, nan=0.0)
        with torch.no_grad():
            y = model(x)
        y = y.reshape(n, -1).tolist()
        golden_rows.extend(zip(ids, y))

    with open(os.path.join(args.out, "golden.csv"), "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["id"] + score_columns(args.outputs))
        for i, ys in golden_rows:
            w.writerow([i] + [repr(v) for v in ys])

    checkpoint = "" if args.checkpoint_every is None else f"\ncheckpoint_every = {args.checkpoint_every}"
    missing = "\nmissing = 0" if args.missing_every else ""
    suffix = "csv" if args.format == "pandas" else args.format
    with open(os.path.join(args.out, "job.toml"), "w") as fh:
        fh.write(f"""# Generated by loadtest/python/make_job.py
[job]
name = "{args.name}"
pool = "{args.pool}"

[input]
format = "{suffix}"
paths = ["data/*.{suffix}"]
id_column = "id"
feature_columns = ["f0..f{args.features - 1}"]{missing}

[model]
path = "model.pt"
device = "cpu"

[batching]
item_rows = {args.item_rows}
inference_batch_size = {args.batch_size}{checkpoint}

[output]
dir = "out"
format = "csv"
""")
    print(f"wrote {args.rows} rows in {args.files} files ({missing_count} values missing), model, golden and job.toml to {args.out}")


if __name__ == "__main__":
    main()
