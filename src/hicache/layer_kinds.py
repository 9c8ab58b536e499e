"""What each layer of a model keeps per token: the kinds a model spec names, per layer.

Full attention (and MLA) keeps KV for every earlier token: continuing a prefix of length L needs
the layer's KV for ``[0, L)``. A sliding-window layer attends over the last ``window`` tokens only:
continuing needs its KV for ``[L - window, L)`` and nothing before. Recurrent layers (Mamba, gated
delta nets, short convolutions) keep a fixed-size state instead; they are the next kind here.

``LayerKinds`` is a plain value (no pydantic, no torch): the config parses it, the namespace
digests its canonical text, the integrations build it from an engine's model config. An empty
``LayerKinds`` means every layer is full attention, so caches of such models keep the keys they
always had.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedModelError

__all__ = ["FULL", "LayerKind", "LayerKinds", "SLIDING", "from_hf_config", "restorable_end"]

FULL = "full"
SLIDING = "sliding"


@dataclass(frozen=True)
class LayerKind:
    """One layer: ``full`` attention, or ``sliding`` over the last ``window`` tokens."""

    kind: str = FULL
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind == FULL:
            if self.window:
                raise ValueError("a full-attention layer has no window")
        elif self.kind == SLIDING:
            if self.window < 1:
                raise ValueError(f"a sliding-window layer needs a window of at least 1 token, got {self.window}")
        else:
            raise ValueError(f"unknown layer kind {self.kind!r}: expected {FULL!r} or {SLIDING!r}")

    @classmethod
    def parse(cls, value: object) -> LayerKind:
        """``"full"``, ``"sliding:512"``, ``{"kind": "sliding", "window": 512}`` or a ``LayerKind``."""
        if isinstance(value, LayerKind):
            return value
        if isinstance(value, str):
            name, _, window = value.strip().partition(":")
            if name == SLIDING and not window:
                raise ValueError("a sliding layer is written 'sliding:<window>', e.g. 'sliding:512'")
            try:
                return cls(name, int(window) if window else 0)
            except ValueError as exc:
                raise ValueError(f"layer {value!r}: {exc}") from None
        if isinstance(value, dict):
            unknown = set(value) - {"kind", "window"}
            if unknown:
                raise ValueError(f"a layer takes 'kind' and 'window', not {sorted(unknown)}")
            window = value.get("window", 0)
            if isinstance(window, bool) or not isinstance(window, int):
                raise ValueError(f"a layer's window must be an integer, got {window!r}")
            return cls(str(value.get("kind", FULL)), window)
        raise ValueError(f"a layer is 'full', 'sliding:<window>' or a mapping, got {type(value).__name__}")

    @property
    def text(self) -> str:
        return FULL if self.kind == FULL else f"{SLIDING}:{self.window}"


@dataclass(frozen=True)
class LayerKinds(Sequence[LayerKind]):
    """The kinds of a model's layers, in order; empty: every layer full attention."""

    layers: tuple[LayerKind, ...] = ()

    @classmethod
    def parse(cls, values: Iterable[object] | None) -> LayerKinds:
        if values is None:
            return cls()
        if isinstance(values, LayerKinds):
            return values
        if isinstance(values, str):
            raise ValueError("layers is a list (e.g. ['sliding:512', 'full']), not a string")
        kinds = tuple(LayerKind.parse(v) for v in values)
        if all(k.kind == FULL for k in kinds):
            return cls()  # all-full is the default layout: one digest for it however it is written
        return cls(kinds)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, index):  # type: ignore[override]
        return self.layers[index]

    def __iter__(self) -> Iterator[LayerKind]:
        return iter(self.layers)

    @property
    def hybrid(self) -> bool:
        """Whether some layer is not full attention."""
        return bool(self.layers)

    @property
    def sliding(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, k in enumerate(self.layers) if k.kind == SLIDING)

    @property
    def full(self) -> tuple[int, ...]:
        """Indices of the layers that keep KV for every token (all of them when not hybrid)."""
        return tuple(i for i, k in enumerate(self.layers) if k.kind == FULL)

    @property
    def window(self) -> int:
        """The widest sliding window (0 when no layer slides): the tokens before a prefix's end that
        every sliding layer may still attend to."""
        return max((k.window for k in self.layers if k.kind == SLIDING), default=0)

    def window_pages(self, page_size: int) -> int:
        """Pages before a prefix's end whose sliding layers a continuation may read (0 when no
        layer slides). One page more than the window spans, so a hit an engine shortens by a page
        (it recomputes the prompt's last token) still finds its window."""
        w = self.window
        return 0 if not w else -(-(w - 1) // page_size) + 1

    @property
    def splits(self) -> bool:
        """Whether pages can be kept in two parts: some layers full, some sliding."""
        return bool(self.sliding) and bool(self.full)

    def canonical(self) -> str:
        """Run-length text of the layout (``"sliding:512*5,full,..."``; ``""`` when every layer is full),
        digested into the namespace so a cache of one layout is never served to another."""
        if not self.layers:
            return ""
        runs: list[list[object]] = []
        for k in self.layers:
            if runs and runs[-1][0] == k.text:
                runs[-1][1] = int(runs[-1][1]) + 1  # type: ignore[call-overload]
            else:
                runs.append([k.text, 1])
        return ",".join(t if n == 1 else f"{t}*{n}" for t, n in runs)  # type: ignore[str-format]

    def sliced(self, first: int, end: int) -> LayerKinds:
        """The kinds of layers ``[first, end)`` (a pipeline stage's)."""
        return LayerKinds.parse(self.layers[first:end]) if self.layers else self


#: Hugging Face ``layer_types`` names of the kinds hicache caches
_HF_LAYER_TYPES = {"full_attention": FULL, "sliding_attention": SLIDING}


def from_hf_config(model_name: str, text: Any) -> LayerKinds:
    """Each layer's kind from a Hugging Face text config: ``layer_types`` (Gemma 3, gpt-oss,
    Qwen3-Next, ...) or a model-wide ``sliding_window`` (Mistral-style). An unknown kind is refused
    (``UnsupportedModelError``), never cached as if it were full attention."""
    layers = int(text.num_hidden_layers)
    layer_types = list(getattr(text, "layer_types", None) or [])
    window = getattr(text, "sliding_window", None)
    if not getattr(text, "use_sliding_window", True):
        window = None  # Qwen2-style: a window in the config, switched off
    if not layer_types:
        layer_types = ["sliding_attention" if window else "full_attention"] * layers
    unknown = sorted({str(t) for t in layer_types if t not in _HF_LAYER_TYPES})
    if unknown:
        raise UnsupportedModelError(
            f"{model_name}: layers of kind {unknown} keep state hicache does not cache yet "
            "(it caches full-attention and sliding-window layers)"
        )
    if len(layer_types) != layers:
        raise UnsupportedModelError(
            f"{model_name}: layer_types lists {len(layer_types)} layers, num_hidden_layers is {layers}"
        )
    if "sliding_attention" in layer_types and not window:
        raise UnsupportedModelError(f"{model_name}: sliding-window layers without a sliding_window in the config")
    return LayerKinds.parse(
        LayerKind(_HF_LAYER_TYPES[t], int(window) if t == "sliding_attention" else 0) for t in layer_types
    )


def restorable_end(end: int, thin: Iterable[tuple[int, int]], window_pages: int) -> int:
    """The longest prefix, at most ``end`` pages, that can be continued exactly: no page among the
    ``window_pages`` before its end is *thin* (its sliding layers' KV absent). ``thin``: page
    ranges ``[first, stop)``. The one rule for every tier (the index, storage probes)."""
    if window_pages <= 0:
        return end
    ranges = sorted(thin)
    while end > 0:
        low = max(0, end - window_pages)
        inside = [max(a, low) for a, b in ranges if a < end and b > low]
        if not inside:
            return end
        end = min(inside)  # a window holding that thin page cannot end past it
    return 0
