#!/usr/bin/env python3
"""Seeds for fuzzing the model-archive reader (.ci/fuzz.sh): small archives
of every kind torch writes, each also deflated and cut short.

    python make_fuzz_seeds.py OUT

Writes into OUT: a TorchScript module (forward with named and defaulted
parameters, a submodule: code under code/__torch__/), a state_dict, a
pickled module, a torch.export program (.pt2, models/model.json with its
torch_version), the TorchScript archive re-packed with deflated entries,
and each of them truncated to half and to all but its last 64 bytes.
"""
import os
import sys
import zipfile
from typing import Optional

import torch


class Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = self.inner(input_ids.float())
        if attention_mask is not None:
            out = out * attention_mask.float().sum()
        return out


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    model = Model().eval()
    paths = []

    def path(name: str) -> str:
        p = os.path.join(out, name)
        paths.append(p)
        return p

    torch.jit.save(torch.jit.script(model), path("scripted.pt"))
    torch.save(model.state_dict(), path("state_dict.pt"))
    torch.save(model, path("pickled.pt"))
    program = torch.export.export(model, (torch.ones(2, 4, dtype=torch.long),))
    torch.export.save(program, path("exported.pt2"))
    deflated = path("scripted-deflated.pt")
    with zipfile.ZipFile(os.path.join(out, "scripted.pt")) as src, zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    for p in list(paths):
        data = open(p, "rb").read()
        with open(p + ".half", "wb") as f:
            f.write(data[: len(data) // 2])
        with open(p + ".short", "wb") as f:
            f.write(data[:-64])
    print(f"{len(os.listdir(out))} seeds in {out}")


if __name__ == "__main__":
    main()
