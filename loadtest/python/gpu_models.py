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

    python3 gpu_models.py --kind text --out DIR --vocab V --dim D --heads H \
        --layers L --ff FF --outputs K --verify DIR/verify.csv

A sentence encoder instead: DIR/tokenizer.json (a word-level vocabulary
`w0..w{V-1}` after `[PAD] [UNK] [CLS] [SEP]`, split on whitespace, each
row wrapped in `[CLS] … [SEP]`), DIR/model.pt (token and position
embeddings, L pre-norm transformer layers of D dimensions, H heads and a
feed-forward of FF, mean pooling where `attention_mask` is 1, a linear head
of K outputs; `forward(input_ids, attention_mask)`), and DIR/golden.csv for
the rows of the verify file (`id,text`), each encoded alone, unpadded.

    python3 gpu_models.py --kind cnn --out DIR --size S --layers L --outputs K \
        --verify DIR/verify.bin

An image CNN instead: DIR/model.pt (L stride-2 3×3 convolutions with batch
norm and ReLU, 32 channels doubling to at most 512, global average pooling,
a linear head of K outputs; `forward` takes `[rows, 3, S, S]`), and
DIR/golden.csv for the images whose preprocessed pixels (float32,
little-endian, channels first, as a worker feeds them) are in the verify
file, their ids one per line in DIR/verify.ids.
"""
import argparse
import csv
import json
import math
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


SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


class Layer(torch.nn.Module):
    def __init__(self, dim: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.ff1 = torch.nn.Linear(dim, ff)
        self.ff2 = torch.nn.Linear(ff, dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        head = dim // self.heads
        q = q.reshape(n, length, self.heads, head).transpose(1, 2)
        k = k.reshape(n, length, self.heads, head).transpose(1, 2)
        v = v.reshape(n, length, self.heads, head).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(head) + bias
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(n, length, dim)
        x = x + self.proj(attended)
        return x + self.ff2(torch.nn.functional.gelu(self.ff1(self.norm2(x))))


class Encoder(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, ff: int, outputs: int):
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, dim)
        self.positions = torch.nn.Embedding(512, dim)
        self.layers = torch.nn.ModuleList(Layer(dim, heads, ff) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, outputs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        x = self.tokens(input_ids) + self.positions(positions)
        mask = attention_mask.unsqueeze(1).unsqueeze(2).to(x.dtype)
        # Padding gets no attention: -10^4 before the softmax (in range for
        # bfloat16 and float16 alike).
        bias = (1.0 - mask) * -10000.0
        for layer in self.layers:
            x = layer(x, bias)
        x = self.norm(x)
        weights = attention_mask.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


class Cnn(torch.nn.Module):
    def __init__(self, layers: int, outputs: int):
        super().__init__()
        blocks = []
        channels = 3
        for i in range(layers):
            out = min(32 * 2**i, 512)
            blocks += [
                torch.nn.Conv2d(channels, out, 3, stride=2, padding=1, bias=False),
                torch.nn.BatchNorm2d(out),
                torch.nn.ReLU(),
            ]
            channels = out
        self.features = torch.nn.Sequential(*blocks)
        self.head = torch.nn.Linear(channels, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def cnn(args: argparse.Namespace) -> None:
    torch.manual_seed(7)
    model = Cnn(args.layers, args.outputs).eval()
    with torch.no_grad():
        # Running statistics that are not the identity, as a trained model's.
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    os.makedirs(args.out, exist_ok=True)
    torch.jit.save(torch.jit.script(model), os.path.join(args.out, "model.pt"))
    with open(os.path.splitext(args.verify)[0] + ".ids", encoding="utf-8") as f:
        ids = [line.strip() for line in f if line.strip()]
    with open(args.verify, "rb") as f:
        raw = bytearray(f.read())
    x = torch.frombuffer(raw, dtype=torch.float32).view(len(ids), 3, args.size, args.size)
    with torch.no_grad():
        y = model(x)
    with open(os.path.join(args.out, "golden.csv"), "w", newline="", encoding="utf-8") as g:
        w = csv.writer(g)
        w.writerow(["id"] + [f"score_{k}" for k in range(args.outputs)])
        for i, row in zip(ids, y.tolist()):
            w.writerow([i] + [repr(v) for v in row])


def tokenizer_json(vocab: int) -> dict:
    words = {t: i for i, t in enumerate(SPECIALS)}
    for k in range(vocab):
        words[f"w{k}"] = len(SPECIALS) + k
    special = lambda t: {"id": t, "ids": [words[t]], "tokens": [t]}  # noqa: E731
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
            ],
            "pair": [
                {"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {"[CLS]": special("[CLS]"), "[SEP]": special("[SEP]")},
        },
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"},
    }


def text(args: argparse.Namespace) -> None:
    torch.manual_seed(7)
    model = Encoder(len(SPECIALS) + args.vocab, args.dim, args.heads, args.layers, args.ff, args.outputs).eval()
    os.makedirs(args.out, exist_ok=True)
    torch.jit.save(torch.jit.script(model), os.path.join(args.out, "model.pt"))
    tok = tokenizer_json(args.vocab)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f)
    words = tok["model"]["vocab"]
    with open(args.verify, newline="", encoding="utf-8") as f, open(
        os.path.join(args.out, "golden.csv"), "w", newline="", encoding="utf-8"
    ) as g:
        reader = csv.reader(f)
        if next(reader) != ["id", "text"]:
            raise SystemExit(f"{args.verify}: the header is not id,text")
        w = csv.writer(g)
        w.writerow(["id"] + [f"score_{k}" for k in range(args.outputs)])
        with torch.no_grad():
            for rec in reader:
                ids = [words["[CLS]"]] + [words.get(t, words["[UNK]"]) for t in rec[1].split()] + [words["[SEP]"]]
                x = torch.tensor([ids], dtype=torch.int64)
                y = model(x, torch.ones_like(x))[0]
                w.writerow([rec[0]] + [repr(v) for v in y.tolist()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["mlp", "text", "cnn"], default="mlp")
    ap.add_argument("--out", required=True)
    ap.add_argument("--features", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--outputs", type=int, required=True)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--ff", type=int)
    ap.add_argument("--size", type=int)
    ap.add_argument("--verify", required=True)
    args = ap.parse_args()
    if args.kind == "text":
        text(args)
        return
    if args.kind == "cnn":
        cnn(args)
        return

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
