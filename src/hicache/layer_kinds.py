"""What each layer of a model keeps per token: the kinds a model spec names, per layer.

Full attention (and MLA) keeps KV for every earlier token: continuing a prefix of length L needs
the layer's KV for ``[0, L)``. A sliding-window layer attends over the last ``window`` tokens only:
continuing needs its KV for ``[L - window, L)`` and nothing before. A recurrent layer (Mamba,
gated delta net, short convolution) keeps a fixed-size state instead: continuing at ``L`` needs that
state as it was after token ``L`` exactly, a *checkpoint*, and nothing else.

A page of the cache has one slot per *cache layer* (``[K|V, page_size, heads, head_dim]``). A full or
sliding layer is one cache layer; a recurrent layer's state is spread over as many ``state`` cache
layers as its bytes need (``cache_layers``), and a page holds its checkpoint there: the state after
the page's last token. A page without one is *thin* in those layers, as a sliding layer's page is
thin where its KV is absent, so every tier, lease, eviction and storage rule of thin pages applies
to checkpoints unchanged (``restorable_end``).

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

__all__ = [
    "FULL", "RECURRENT", "SLIDING", "STATE", "LayerKind", "LayerKinds", "StateTensor", "from_hf_config",
    "parse_state", "restorable_end",
]

FULL = "full"
SLIDING = "sliding"
RECURRENT = "recurrent"  # a model layer with a fixed-size state (written ``recurrent:<state>``)
STATE = "state"  # a cache layer holding part of a recurrent layer's checkpoint (``cache_layers``)

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class StateTensor:
    """One tensor of a recurrent layer's state: ``name=dims/dtype`` (``conv=64x3/float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        n = _ITEMSIZE[self.dtype]
        for d in self.shape:
            n *= d
        return n

    @property
    def text(self) -> str:
        return f"{self.name}={'x'.join(map(str, self.shape))}/{self.dtype}"


def parse_state(text: str) -> tuple[StateTensor, ...]:
    """``"conv=64x3/float32+rec=4x16x16/float32"``: the tensors of a recurrent layer's state, in order."""
    out = []
    for item in text.split("+"):
        name, eq, rest = item.partition("=")
        dims, slash, dtype = rest.partition("/")
        try:
            shape = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            shape = ()
        if not (name and eq and slash and shape) or min(shape) < 1 or dtype not in _ITEMSIZE:
            raise ValueError(
                f"a recurrent state is 'name=dims/dtype' joined by '+' (e.g. 'conv=64x3/float32'), got {item!r}"
            )
        out.append(StateTensor(name, shape, dtype))
    return tuple(out)


@dataclass(frozen=True)
class LayerKind:
    """One layer: ``full`` attention, ``sliding`` over the last ``window`` tokens, ``recurrent``
    with a fixed-size ``state`` (``parse_state``), or a cache layer of such a state (``state``)."""

    kind: str = FULL
    window: int = 0
    state: str = ""

    def __post_init__(self) -> None:
        if self.kind != SLIDING and self.window:
            raise ValueError(f"a {self.kind} layer has no window")
        if self.kind != RECURRENT and self.state:
            raise ValueError(f"a {self.kind} layer has no state")
        if self.kind == SLIDING:
            if self.window < 1:
                raise ValueError(f"a sliding-window layer needs a window of at least 1 token, got {self.window}")
        elif self.kind == RECURRENT:
            parse_state(self.state)
        elif self.kind not in (FULL, STATE):
            raise ValueError(f"unknown layer kind {self.kind!r}: expected {FULL!r}, {SLIDING!r} or {RECURRENT!r}")

    @classmethod
    def parse(cls, value: object) -> LayerKind:
        """``"full"``, ``"sliding:512"``, ``"recurrent:conv=64x3/float32"``, a mapping of those
        fields (``{"kind": "sliding", "window": 512}``) or a ``LayerKind``."""
        if isinstance(value, LayerKind):
            return value
        if isinstance(value, str):
            name, _, arg = value.strip().partition(":")
            if name in (SLIDING, RECURRENT) and not arg:
                raise ValueError(f"a {name} layer is written '{name}:<{'window' if name == SLIDING else 'state'}>'")
            try:
                if name == RECURRENT:
                    return cls(name, state=arg)
                return cls(name, int(arg) if arg else 0)
            except ValueError as exc:
                raise ValueError(f"layer {value!r}: {exc}") from None
        if isinstance(value, dict):
            unknown = set(value) - {"kind", "window", "state"}
            if unknown:
                raise ValueError(f"a layer takes 'kind', 'window' and 'state', not {sorted(unknown)}")
            window = value.get("window", 0)
            if isinstance(window, bool) or not isinstance(window, int):
                raise ValueError(f"a layer's window must be an integer, got {window!r}")
            return cls(str(value.get("kind", FULL)), window, str(value.get("state", "")))
        raise ValueError(f"a layer is 'full', 'sliding:<window>', 'recurrent:<state>' or a mapping, got {type(value).__name__}")

    @property
    def text(self) -> str:
        if self.kind == SLIDING:
            return f"{SLIDING}:{self.window}"
        if self.kind == RECURRENT:
            return f"{RECURRENT}:{self.state}"
        return self.kind

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        return parse_state(self.state) if self.kind == RECURRENT else ()

    @property
    def state_bytes(self) -> int:
        """Bytes of one checkpoint of this layer (0 unless recurrent)."""
        return sum(t.nbytes for t in self.state_tensors)


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
        names = {k.kind for k in kinds}
        if SLIDING in names and names & {RECURRENT, STATE}:
            raise ValueError("a model with both sliding-window and recurrent layers is not supported yet")
        if RECURRENT in names and STATE in names:
            raise ValueError("'state' layers are a recurrent layer's cache layers: list the model's layers")
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
    def recurrent(self) -> tuple[int, ...]:
        """Indices of the recurrent layers (model layers with a fixed-size state)."""
        return tuple(i for i, k in enumerate(self.layers) if k.kind == RECURRENT)

    @property
    def partial(self) -> tuple[int, ...]:
        """Indices of the layers a page may lack and still be cached (it is *thin* there):
        sliding-window layers, and the ``state`` cache layers of recurrent ones."""
        return tuple(i for i, k in enumerate(self.layers) if k.kind in (SLIDING, STATE))

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
        (it recomputes the prompt's last token) still finds its window. With recurrent layers: 1,
        the page whose checkpoint a continuation restores (an engine asks for a prefix shorter
        than its prompt rather than shortening a hit, which would need another checkpoint)."""
        w = self.window
        if any(k.kind in (RECURRENT, STATE) for k in self.layers):
            return 1  # the page ending where the prefix ends holds its checkpoint
        return 0 if not w else -(-(w - 1) // page_size) + 1

    @property
    def splits(self) -> bool:
        """Whether pages can be kept in two parts: some layers full, some a page may lack."""
        return bool(self.partial) and bool(self.full)

    def slots(self, slot_bytes: int) -> tuple[tuple[int, int], ...]:
        """Per model layer, ``(first cache layer, cache layers)``: one for a full or sliding layer,
        ``ceil(state_bytes / slot_bytes)`` for a recurrent one (``slot_bytes``: one layer of one page)."""
        out, at = [], 0
        for k in self.layers:
            n = -(-k.state_bytes // slot_bytes) if k.kind == RECURRENT else 1
            out.append((at, n))
            at += n
        return tuple(out)

    def cache_layers(self, slot_bytes: int) -> LayerKinds:
        """The layers of a cache page: each recurrent layer becomes its ``state`` cache layers."""
        if not self.recurrent:
            return self
        out: list[LayerKind] = []
        for k, (_, n) in zip(self.layers, self.slots(slot_bytes)):
            out += [LayerKind(STATE)] * n if k.kind == RECURRENT else [k]
        return LayerKinds(tuple(out))

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
        """The kinds of layers ``[first, end)`` (a pipeline stage's; recurrent models have one stage)."""
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
            f"{model_name}: layers of kind {unknown} keep a recurrent state, which hicache caches through its "
            "transformers integration only (CachedCausalLM); here it caches full-attention and sliding-window layers"
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
