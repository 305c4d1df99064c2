#!/usr/bin/env python3
"""Shadow models of a make_job.py job, and what a shadow run must report.

    python make_shadow_models.py --base DIR/model.pt --out-dir DIR [--raise-above T]

Writes into DIR:
- candidate.pt: the base model "retrained" — its last layer's weights and
  bias moved by seeded noise — so its outputs differ from the base's by a
  known amount;
- raising.pt: the base model, except that forward raises on any mini-batch
  holding a row whose f0 is above T (default 1.5);
- shadow_golden.csv: the candidate's outputs for every row of DIR/data/*.csv,
  as the `<name>_shadow` columns of `[output] shadow = "columns"`;
- shadow_expected.json: the figures the job's summary must give, computed
  here in float64 from PyTorch's own float32 outputs of both models: rows,
  per output column the largest and mean absolute difference, Pearson's
  correlation and both means; the rows whose top class agrees and the
  confusion table (job's class × shadow's class); and the rows raising.pt
  raises on.
"""
import argparse
import csv
import glob
import json
import os

import torch


class Raising(torch.nn.Module):
    def __init__(self, inner, above: float):
        super().__init__()
        self.inner = inner
        self.above = above

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] > self.above).any()):
            raise RuntimeError("shadow test model: a row with f0 above the threshold")
        return self.inner(x)


def read_rows(data_dir):
    ids, rows = [], []
    for path in sorted(glob.glob(os.path.join(data_dir, "*.csv"))):
        with open(path, newline="") as f:
            r = csv.reader(f)
            next(r)
            for line in r:
                ids.append(line[0])
                rows.append([float(v) for v in line[1:]])
    return ids, torch.tensor(rows, dtype=torch.float32)


def top_class(y: torch.Tensor) -> torch.Tensor:
    # Largest value, the lower index on ties (as the `label` column).
    return torch.argmax(y, dim=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--raise-above", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=11)
    a = ap.parse_args()
    torch.manual_seed(a.seed)

    base = torch.jit.load(a.base)
    candidate = torch.jit.load(a.base)
    with torch.no_grad():
        for name, p in candidate.named_parameters():
            if name.startswith("l3."):
                p.add_(torch.randn_like(p) * 0.05)
    torch.jit.save(candidate, os.path.join(a.out_dir, "candidate.pt"))
    torch.jit.save(torch.jit.script(Raising(torch.jit.load(a.base), a.raise_above)), os.path.join(a.out_dir, "raising.pt"))

    ids, x = read_rows(os.path.join(a.out_dir, "data"))
    with torch.no_grad():
        y_main = base(x)
        y_cand = candidate(x)
    if y_main.dim() == 1:
        y_main, y_cand = y_main.unsqueeze(1), y_cand.unsqueeze(1)
    width = y_main.shape[1]
    names = ["score"] if width == 1 else [f"score_{i}" for i in range(width)]
    with open(os.path.join(a.out_dir, "shadow_golden.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"{n}_shadow" for n in names])
        for i, row in zip(ids, y_cand.tolist()):
            w.writerow([i] + [repr(v) for v in row])

    m, c = y_main.double(), y_cand.double()
    d = (m - c).abs()
    columns = []
    for k, n in enumerate(names):
        xm, xc = m[:, k], c[:, k]
        r = torch.corrcoef(torch.stack([xm, xc]))[0, 1].item()
        columns.append({
            "name": n,
            "max_abs_diff": d[:, k].max().item(),
            "mean_abs_diff": d[:, k].mean().item(),
            "pearson": r,
            "mean_main": xm.mean().item(),
            "mean_shadow": xc.mean().item(),
        })
    a_cls, b_cls = top_class(y_main), top_class(y_cand)
    confusion = [[0] * width for _ in range(width)]
    for p, q in zip(a_cls.tolist(), b_cls.tolist()):
        confusion[p][q] += 1
    expected = {
        "rows": len(ids),
        "columns": columns,
        "agree": int((a_cls == b_cls).sum().item()),
        "confusion": confusion,
        "raising_rows": int((x[:, 0] > a.raise_above).sum().item()),
    }
    with open(os.path.join(a.out_dir, "shadow_expected.json"), "w") as f:
        json.dump(expected, f, indent=1)


if __name__ == "__main__":
    main()
