"""The training tasks of the benchmarks: text that ships with Python, and small character models.

bench/convergence.py trains on them to compare the compressed optimizers' losses with their
uncompressed selves, bench/train_step.py to time whole steps; sharing them means a step time and
a convergence figure are about the same model and data. Nothing is downloaded:

    char-mlp      Python's own standard-library sources, a character MLP (embedding of a fixed
                  context window -> MLP -> the next character)
    transformer   the English prose of Python's help topics (`pydoc_data.topics`), a small causal
                  transformer predicting the next character at every position

Every task is deterministic: the same corpus, ids and windows for a given generator seed.
"""

from __future__ import annotations

import glob
import os

import torch

TASKS = {
    "char-mlp": "char-level LM (MLP) on Python stdlib sources",
    "transformer": "char-level causal transformer on Python's help topics (pydoc_data)",
}
VOCAB = 128
"""Character ids: ASCII codes compacted to the characters seen often (see load_text)."""


def stdlib_sources(limit: int) -> bytes:
    """The first `limit` bytes of the standard library's .py sources, in sorted file order."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def help_topics(limit: int) -> bytes:
    """The English text of Python's help topics (pydoc_data.topics), in sorted topic order."""
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")[:limit]


def load_text(task: str, limit: int) -> torch.Tensor:
    """The task's corpus (its first `limit` characters) as character ids below VOCAB."""
    raw = stdlib_sources(limit) if task == "char-mlp" else help_topics(limit)
    codes = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    # Characters rarer than 1 in 10^4 (and non-ASCII bytes) share id 0, so that every id
    # occurs in training.
    counts = torch.bincount(codes, minlength=256)
    keep = (counts >= max(1, len(codes) // 10_000)).nonzero().flatten()
    keep = keep[keep < 128]
    table = torch.zeros(256, dtype=torch.long)
    table[keep] = torch.arange(1, len(keep) + 1)
    return table[codes]


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> torch.Tensor:
    """Sequences of context + 1 characters starting at `starts`: the inputs and their targets."""
    return text[starts[:, None] + torch.arange(context + 1)]


def random_windows(text: torch.Tensor, count: int, context: int, generator: torch.Generator) -> torch.Tensor:
    """`count` windows of `text` at uniformly drawn starts: a minibatch, or a validation set."""
    starts = torch.randint(0, len(text) - context - 1, (count,), generator=generator)
    return windows(text, starts, context)


class CharMLP(torch.nn.Module):
    """Embed each of `context` characters, concatenate, two hidden layers, next-character logits."""

    def __init__(self, context: int, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, embed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(context * embed, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.GELU(),
            torch.nn.Linear(hidden, VOCAB),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the character after each row of `context` characters."""
        return self.net(self.embed(x).flatten(1))

    def loss(self, seq: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the last character of each window given the others."""
        return torch.nn.functional.cross_entropy(self(seq[:, :-1]), seq[:, -1])


class CharTransformer(torch.nn.Module):
    """A causal transformer encoder (pre-norm) predicting the next character at every position."""

    def __init__(self, context: int, width: int, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        block = torch.nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, VOCAB)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the next character at every position of `x`."""
        h = self.blocks(self.embed(x) + self.position, mask=self.causal, is_causal=True)
        return self.head(h)

    def loss(self, seq: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of every next character of each window."""
        return torch.nn.functional.cross_entropy(self(seq[:, :-1]).flatten(0, 1), seq[:, 1:].flatten())


def task_model(task: str, context: int, embed: int, hidden: int) -> CharMLP | CharTransformer:
    """The task's model (the transformer's width is `hidden`; it embeds at that width)."""
    if task == "char-mlp":
        return CharMLP(context, embed, hidden)
    return CharTransformer(context, hidden)
