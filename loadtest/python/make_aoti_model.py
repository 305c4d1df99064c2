#!/usr/bin/env python3
"""Makes one MLP in both formats batchfleet runs, plus input and PyTorch's
outputs, to compare them on the same model:

    make_aoti_model.py OUT [--rows N] [--features F] [--hidden H] [--outputs K] [--seed S]

Writes into OUT:
  model.pt       torch.jit.script of the MLP (TorchScript)
  model.pt2      the same MLP exported (torch.export.export, the batch
                 dimension dynamic) and compiled ahead of time for the CPU
                 by torch._inductor.aoti_compile_and_package (needs a C++
                 compiler here, not where it runs)
  program.pt2    the exported program alone (torch.export.save), which is
                 not compiled: what batchfleet refuses with the conversion
  input.csv      id,f0..f{F-1}
  expected.csv   id,score_0..: the eager model's outputs
"""

import argparse
import csv
import os
import time

import torch


class MLP(torch.nn.Module):
    def __init__(self, features, hidden, outputs):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(features, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--features", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--outputs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=3)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    model = MLP(a.features, a.hidden, a.outputs).eval()
    x = torch.randn(a.rows, a.features)
    with open(os.path.join(a.out, "input.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"f{i}" for i in range(a.features)])
        for i, row in enumerate(x.tolist()):
            w.writerow([f"r{i}"] + [repr(v) for v in row])
    # The model sees the values as written (float32 round trip).
    with torch.no_grad():
        y = model(x)
    with open(os.path.join(a.out, "expected.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id"] + [f"score_{j}" for j in range(a.outputs)])
        for i, row in enumerate(y.tolist()):
            w.writerow([f"r{i}"] + [repr(v) for v in row])
    torch.jit.script(model).save(os.path.join(a.out, "model.pt"))
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    example = (torch.randn(8, a.features),)
    program = torch.export.export(model, example, dynamic_shapes={"x": {0: batch}})
    torch.export.save(program, os.path.join(a.out, "program.pt2"))
    started = time.time()
    torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(a.out, "model.pt2"))
    print(f"compiled model.pt2 in {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
