"""Benchmark workloads as conversations: each turn's prompt is the history plus a new chunk.

* ``MultiTurn`` (the shape of SGLang's ``bench_multiturn.py``): clients, each with ``rounds``
  turns; a turn's prompt is everything said so far (prompts and answers) plus a new request.
* ``LongContext``: a few long documents and many questions on each; each question is a
  one-turn conversation whose prompt is the document plus the question.

Token ids are random (seeded) and avoid the low ids where vocabularies keep special tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Conversation", "MultiTurn", "LongContext", "Workload"]

_FIRST_ID = 100  # below this, vocabularies keep their special tokens


@dataclass
class Conversation:
    """One client's turns; ``rounds[i]`` is turn ``i``'s round (for per-round figures)."""

    id: int
    chunks: list[list[int]]
    rounds: list[int]
    output_len: int
    history: list[int] = field(default_factory=list)
    turn: int = 0

    @property
    def done(self) -> bool:
        return self.turn >= len(self.chunks)

    def next_prompt(self) -> list[int]:
        return self.history + self.chunks[self.turn]

    def advance(self, prompt: list[int], output: list[int]) -> None:
        self.history = prompt + output
        self.turn += 1


@dataclass(frozen=True)
class MultiTurn:
    """``clients`` conversations of ``rounds`` turns; each turn adds ``request_len`` + ``output_len``."""

    clients: int = 4
    rounds: int = 10
    request_len: int = 128
    output_len: int = 4
    seed: int = 0
    name = "multiturn"

    def conversations(self, vocab_size: int) -> list[Conversation]:
        rng = random.Random(self.seed)
        return [
            Conversation(
                id=c,
                chunks=[_tokens(rng, self.request_len, vocab_size) for _ in range(self.rounds)],
                rounds=list(range(self.rounds)),
                output_len=self.output_len,
            )
            for c in range(self.clients)
        ]

    def kv_tokens(self) -> int:
        """Distinct tokens whose KV the whole trace computes: every client's final history."""
        return self.clients * self.rounds * (self.request_len + self.output_len)

    @property
    def requests(self) -> int:
        return self.clients * self.rounds


@dataclass(frozen=True)
class LongContext:
    """``documents`` of ``document_len`` tokens, ``questions`` different questions on each."""

    documents: int = 4
    document_len: int = 1024
    questions: int = 8
    question_len: int = 32
    output_len: int = 4
    seed: int = 0
    name = "long-context"

    def conversations(self, vocab_size: int) -> list[Conversation]:
        rng = random.Random(self.seed)
        docs = [_tokens(rng, self.document_len, vocab_size) for _ in range(self.documents)]
        out = []
        for q in range(self.questions):  # question-major: the first question of each document comes first
            for doc in docs:
                chunk = doc + _tokens(rng, self.question_len, vocab_size)
                out.append(Conversation(id=len(out), chunks=[chunk], rounds=[q], output_len=self.output_len))
        return out

    def kv_tokens(self) -> int:
        return self.documents * (self.document_len + self.questions * (self.question_len + self.output_len))

    @property
    def rounds(self) -> int:
        return self.questions

    @property
    def requests(self) -> int:
        return self.documents * self.questions


Workload = MultiTurn | LongContext


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab_size) for _ in range(n)]
