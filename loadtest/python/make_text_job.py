#!/usr/bin/env python3
"""Makes a text job offline: a corpus, a WordPiece tokenizer.json trained on
it, a small BERT-like encoder (TorchScript) and PyTorch's own outputs.

    make_text_job.py OUT [--rows N] [--seed S] [--dim D] [--max-length L]
                         [--format csv|jsonl|parquet|all] [--batch B]
                         [--output pooled|hidden|dict|typed]

Writes into OUT:
  corpus.<fmt>       (each format with --format all) id,text,f0,f1 rows:
                     texts of varied lengths, some empty strings, non-ASCII
                     text and a few very long rows (truncated at
                     --max-length); f0, f1 two numbers per row
  tokenizer.json     WordPiece trained on the corpus with Python's `tokenizers`
  encoder.pt         torch.jit.script of forward(input_ids, attention_mask):
                     a TransformerEncoder with seeded random weights; returns
                     the masked mean of its last hidden state [rows, D]
                     (--output pooled, the default), the hidden state
                     itself [rows, L, D] (--output hidden), or a dict
                     {"pooled": [rows, D], "hidden": [rows, L, D],
                     "logits": [rows, 3]} (--output dict). --output typed:
                     forward(input_ids, attention_mask, token_type_ids,
                     numeric) adds a token type embedding and a projection
                     of the float32 [rows, 2] numeric columns to the pooled
                     output
  expected_ids.jsonl {"id", "ids"} per row: Python's token ids (truncated at
                     --max-length, special tokens added, no padding)
  expected.csv       id,score_0..score_{D-1}: PyTorch's pooled output for
                     every row, run in mini-batches of --batch rows padded to
                     each mini-batch's longest row (pad id 0, mask 0); for
                     hidden and dict, the masked mean of the hidden state
  expected_cls.csv   (hidden, dict) the hidden state's first position
  expected_logits.csv (dict) id,score_0..score_2: the logits

Everything is seeded, so the same arguments make the same files.
"""

import argparse
import csv
import json
import os
import random

from typing import Dict

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

WORDS = (
    "the a of to and in is was for on that with as by at from this be are it an or "
    "model batch fleet worker queue item row score data text token vector review ticket "
    "search embed order ship delay refund great terrible fast slow price quality support "
    "customer product service night morning happy sad blue green red coffee tea river "
    "mountain city train plane bridge window garden music film book paper letter"
).split()
NON_ASCII = ["café", "naïve", "Zürich", "smörgåsbord", "日本語", "东京", "Ελληνικά", "😀", "señor", "übung"]


def sentence(rng, n):
    words = []
    for _ in range(n):
        if rng.random() < 0.06:
            words.append(rng.choice(NON_ASCII))
        else:
            words.append(rng.choice(WORDS))
    text = " ".join(words)
    if rng.random() < 0.3:
        text = text.capitalize() + rng.choice([".", "!", "?", ","])
    return text


def corpus(rows, seed):
    rng = random.Random(seed)
    texts = []
    for i in range(rows):
        r = rng.random()
        if r < 0.02:
            texts.append("")
        elif r < 0.04:
            texts.append(sentence(rng, rng.randint(300, 600)))  # longer than max_length
        elif r < 0.5:
            texts.append(sentence(rng, rng.randint(1, 12)))
        else:
            texts.append(sentence(rng, rng.randint(12, 60)))
    return texts


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    return tok


class Encoder(torch.nn.Module):
    def __init__(self, vocab, dim, layers, max_len, pooled):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        layer = torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=dim * 2, dropout=0.0, batch_first=True)
        # No nested-tensor fast path: it would drop padded positions and
        # make outputs depend on the padding in a way eval() hides.
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooled = pooled

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.tok(input_ids) + self.pos(positions)
        return self.encoder(x, src_key_padding_mask=attention_mask == 0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.hidden(input_ids, attention_mask)
        if not self.pooled:
            return h
        return mean_pool(h, attention_mask)


def mean_pool(h: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    m = attention_mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp(min=1.0)


class DictEncoder(torch.nn.Module):
    """Returns several outputs by name, as transformers models do."""

    def __init__(self, base: Encoder, dim: int):
        super().__init__()
        self.base = base
        self.head = torch.nn.Linear(dim, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Dict[str, torch.Tensor]:
        h = self.base.hidden(input_ids, attention_mask)
        pooled = mean_pool(h, attention_mask)
        return {"pooled": pooled, "hidden": h, "logits": self.head(pooled)}


class TypedEncoder(torch.nn.Module):
    """Takes token type ids and numeric columns beside the text."""

    def __init__(self, base: Encoder, dim: int):
        super().__init__()
        self.base = base
        self.types = torch.nn.Embedding(2, dim)
        self.numeric = torch.nn.Linear(2, dim)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor,
        numeric: torch.Tensor,
    ) -> torch.Tensor:
        h = self.base.hidden(input_ids, attention_mask) + self.types(token_type_ids)
        return mean_pool(h, attention_mask) + self.numeric(numeric)


def padded(batch_ids):
    width = max(len(ids) for ids in batch_ids)
    ids = torch.zeros((len(batch_ids), width), dtype=torch.int64)
    mask = torch.zeros((len(batch_ids), width), dtype=torch.int64)
    for r, row in enumerate(batch_ids):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[r, : len(row)] = 1
    return ids, mask


def numbers(texts, seed):
    rng = random.Random(seed + 1)
    return [(round(len(t) / 100.0, 4), round(rng.uniform(-1.0, 1.0), 4)) for t in texts]


def write_corpus(out, fmt, ids, texts, nums):
    path = os.path.join(out, f"corpus.{fmt}")
    if fmt == "csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["id", "text", "f0", "f1"])
            for i, t, (a, b) in zip(ids, texts, nums):
                w.writerow([i, t, a, b])
    elif fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for i, t, (a, b) in zip(ids, texts, nums):
                f.write(json.dumps({"id": i, "text": t, "f0": a, "f1": b}, ensure_ascii=False) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table(
            {
                "id": ids,
                "text": texts,
                "f0": pa.array([a for a, _ in nums], pa.float32()),
                "f1": pa.array([b for _, b in nums], pa.float32()),
            }
        )
        pq.write_table(table, path, row_group_size=2000)
    return path


def write_rows(path, ids, lo, rows, width, append):
    with open(path, "a" if append else "w", newline="") as f:
        w = csv.writer(f)
        if not append:
            w.writerow(["id"] + [f"score_{j}" for j in range(width)])
        for r, row in enumerate(rows):
            w.writerow([ids[lo + r]] + [repr(v) for v in row])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--format", choices=["csv", "jsonl", "parquet", "all"], default="csv")
    ap.add_argument("--output", choices=["pooled", "hidden", "dict", "typed"], default="pooled")
    ap.add_argument("--no-expected", action="store_true", help="skip PyTorch's outputs (benchmarks)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(a.seed)
    texts = corpus(a.rows, a.seed)
    nums = numbers(texts, a.seed)
    ids = [f"doc-{i:07d}" for i in range(a.rows)]
    for fmt in ["csv", "jsonl", "parquet"] if a.format == "all" else [a.format]:
        write_corpus(a.out, fmt, ids, texts, nums)

    tok = train_tokenizer(texts, a.vocab)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(a.out, "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(a.max_length)
    encodings = tok.encode_batch(texts)
    encoded = [e.ids for e in encodings]
    type_ids = [e.type_ids for e in encodings]
    with open(os.path.join(a.out, "expected_ids.jsonl"), "w", encoding="utf-8") as f:
        for i, e in zip(ids, encoded):
            f.write(json.dumps({"id": i, "ids": e}) + "\n")

    base = Encoder(tok.get_vocab_size(), a.dim, a.layers, a.max_length, a.output == "pooled")
    model = {
        "pooled": lambda: base,
        "hidden": lambda: base,
        "dict": lambda: DictEncoder(base, a.dim),
        "typed": lambda: TypedEncoder(base, a.dim),
    }[a.output]().eval()
    scripted = torch.jit.script(model)
    scripted.save(os.path.join(a.out, "encoder.pt"))
    if a.no_expected:
        return
    with torch.no_grad():
        for lo in range(0, a.rows, a.batch):
            x, m = padded(encoded[lo : lo + a.batch])
            t, _ = padded(type_ids[lo : lo + a.batch])
            if a.output == "typed":
                numeric = torch.tensor(nums[lo : lo + a.batch], dtype=torch.float32)
                y = model(x, m, t, numeric)
            else:
                y = model(x, m)
            outputs = {}
            if isinstance(y, dict):
                outputs["expected_logits.csv"] = y["logits"]
                y = y["hidden"]
            if y.dim() == 3:
                outputs["expected_cls.csv"] = y[:, 0, :]
                y = mean_pool(y, m)
            outputs["expected.csv"] = y
            for name, values in outputs.items():
                rows = values.tolist()
                write_rows(os.path.join(a.out, name), ids, lo, rows, len(rows[0]), lo > 0)


if __name__ == "__main__":
    main()
