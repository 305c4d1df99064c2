"""The models of `batchfleet-loadtest gpu-check --local`, and PyTorch's own
predictions for a sample of its rows.

    python3 gpu_models.py --out DIR --features F --hidden H --layers L --outputs K \
        --verify DIR/verify.csv

Needs only `torch` and the standard library (a machine with PyTorch and
nothing else runs it). Writes DIR/model.pt, a TorchScript MLP of F inputs,
L hidden layers of H units (GELU) and K outputs, with seeded weights scaled
so that activations stay near unit size in any precision, and
DIR/golden.csv: `id,score_0..score_{K-1}` for the rows of the verify file
(`id,f0..f{F-1}`), computed in float32 on the CPU.
"""
import argparse
import csv
import os

import torch


class Mlp(torch.nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, outputs: int):
        super().__init__()
        sizes = [features] + [hidden] * layers
        self.hidden = torch.nn.ModuleList(
            torch.nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])
        )
        self.out = torch.nn.Linear(sizes[-1], outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = torch.nn.functional.gelu(layer(x))
        return self.out(x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--features", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--outputs", type=int, required=True)
    ap.add_argument("--verify", required=True)
    args = ap.parse_args()

    torch.manual_seed(7)
    model = Mlp(args.features, args.hidden, args.layers, args.outputs).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=(1.0 / p.shape[1]) ** 0.5)
            else:
                p.zero_()
    os.makedirs(args.out, exist_ok=True)
    torch.jit.save(torch.jit.script(model), os.path.join(args.out, "model.pt"))

    ids, rows = [], []
    with open(args.verify, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        if len(header) != args.features + 1:
            raise SystemExit(f"{args.verify}: {len(header) - 1} features, expected {args.features}")
        for rec in reader:
            ids.append(rec[0])
            rows.append([float(v) for v in rec[1:]])
    with torch.no_grad():
        y = model(torch.tensor(rows, dtype=torch.float32))
    with open(os.path.join(args.out, "golden.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"score_{k}" for k in range(args.outputs)])
        for i, row in zip(ids, y.tolist()):
            w.writerow([i] + [repr(v) for v in row])


if __name__ == "__main__":
    main()
