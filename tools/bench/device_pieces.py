"""A file too large for one call to a lent GPU machine, carried in pieces over consecutive calls.

    python -m tools.bench.device_pieces split FILE --out runs/carry [--max-piece-mib 47]   # here
    python -m tools.bench.device_pieces stash runs/carry                                    # there, each call
    python -m tools.bench.device_pieces join --name NAME --dest DEST                        # there, once all came

A call to a lent machine takes at most 64 MiB of the working tree with it (tools/bench/gpu_loan.md);
SmolLM2-135M-Instruct's Q4_1 GGUF is 93.8 MiB. ``split`` cuts it into pieces of at most
``--max-piece-mib`` (``NAME.part-I-of-N``) in an ignored folder; each piece is self-describing: one
JSON header line (``HEADER_KEYS``: the whole file's name, size and sha256, this piece's index,
count, offset, size and sha256), then its bytes. Each call carries one piece; ``stash`` copies the
pieces it finds (each checked against its own sha256) into the stash folder outside the
repository (``stash_dir()``: beside fetch_smollm2's cache), which outlives the call while the
machine stays warm; ``join`` puts the pieces of NAME together once all are there, checks the
whole file's sha256 and renames it into DEST (written under a temp name: DEST is whole or absent).

Bad input (a missing piece, a piece or a whole file whose sha256 differs, pieces of two different
files) is one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


EXIT_BAD_INPUT = 2
MAX_HEADER_BYTES = 4096
"""A piece's header line is read up to here: a file that is not a piece fails at once."""
DEFAULT_MAX_PIECE_MIB = 47.0
"""Two pieces of the 93.8 MiB GGUF, each leaving ~17 MiB of a call's 64 MiB to the checkout
(~5 MiB), the data and the wheels."""


class PieceError(ValueError):
    """A one-line reason the pieces cannot be split, stashed or joined."""


@dataclass(frozen=True)
class Header:
    """What a piece says about itself and about the whole file."""

    name: str          # the whole file's name
    size: int          # the whole file's bytes
    sha256: str        # the whole file's
    index: int         # 1-based
    count: int
    offset: int        # where this piece's bytes start in the whole file
    piece_size: int
    piece_sha256: str


HEADER_KEYS = tuple(Header.__dataclass_fields__)


def stash_dir() -> Path:
    """Where pieces wait between calls: ``<fetch_smollm2's cache root>/pieces`` (outside the
    repository, so no call's working-tree copy replaces it)."""
    from tools.fetch_smollm2 import default_cache_dir

    return default_cache_dir().parent / "pieces"


def piece_name(name: str, index: int, count: int) -> str:
    return f"{name}.part-{index}-of-{count}"


def sha256_of(path: Path, start: int = 0, length: int | None = None) -> str:
    """sha256 of ``length`` bytes of ``path`` from ``start`` (to the end when None)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = length
        while left is None or left > 0:
            block = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not block:
                break
            digest.update(block)
            if left is not None:
                left -= len(block)
    return digest.hexdigest()


def piece_bounds(size: int, max_piece: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece: the fewest pieces of at most ``max_piece`` bytes, of
    near-equal length (sizes [N] -> N pieces; the lengths sum to ``size``)."""
    if max_piece < 1:
        raise PieceError(f"--max-piece-mib must be > 0, got {max_piece} bytes")
    count = max(1, -(-size // max_piece))
    base, extra = divmod(size, count)
    bounds, offset = [], 0
    for i in range(count):
        length = base + (i < extra)
        bounds.append((offset, length))
        offset += length
    return bounds


def _write_atomic(dest: Path, write) -> None:
    """``write(file)`` into a temp file beside ``dest``, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def _copy_range(src: Path, dst, start: int, length: int) -> None:
    with open(src, "rb") as f:
        f.seek(start)
        while length > 0:
            block = f.read(min(1 << 20, length))
            if not block:
                raise PieceError(f"{src}: ended {length} bytes early")
            dst.write(block)
            length -= len(block)


def split(path: Path, out_dir: Path, max_piece_mib: float = DEFAULT_MAX_PIECE_MIB) -> list[Path]:
    """Write ``path`` as pieces of at most ``max_piece_mib`` MiB into ``out_dir``; returns them
    (stale pieces of the same name with another count are removed)."""
    if not path.is_file():
        raise PieceError(f"{path}: no such file")
    size = path.stat().st_size
    whole = sha256_of(path)
    bounds = piece_bounds(size, int(max_piece_mib * 2**20))
    for stale in out_dir.glob(f"{path.name}.part-*"):
        stale.unlink()
    written = []
    for i, (offset, length) in enumerate(bounds, start=1):
        header = Header(path.name, size, whole, i, len(bounds), offset, length, sha256_of(path, offset, length))
        dest = out_dir / piece_name(path.name, i, len(bounds))
        _write_atomic(dest, lambda f, h=header: (f.write(json.dumps(asdict(h)).encode() + b"\n"),
                                                  _copy_range(path, f, h.offset, h.piece_size)))
        written.append(dest)
    return written


def read_header(piece: Path) -> tuple[Header, int]:
    """(the piece's header, where its bytes start); PieceError for a file that is not a piece."""
    with open(piece, "rb") as f:
        line = f.readline(MAX_HEADER_BYTES)
    try:
        raw = json.loads(line)
        header = Header(**{k: raw[k] for k in HEADER_KEYS})
    except (ValueError, KeyError, TypeError):
        raise PieceError(f"{piece}: not a piece written by tools/bench/device_pieces.py split (no header line)") from None
    if piece.stat().st_size != len(line) + header.piece_size:
        raise PieceError(f"{piece}: {piece.stat().st_size - len(line)} bytes after the header, the header says "
                         f"{header.piece_size} (cut short in transit?)")
    return header, len(line)


def check_piece(piece: Path) -> Header:
    """The piece's header once its bytes match its own sha256; PieceError otherwise."""
    header, start = read_header(piece)
    got = sha256_of(piece, start, header.piece_size)
    if got != header.piece_sha256:
        raise PieceError(f"{piece}: sha256 {got[:16]}... differs from its header's {header.piece_sha256[:16]}... "
                         "(damaged in transit; split it again)")
    return header


def stash(src_dir: Path, dest_dir: Path | None = None) -> list[Path]:
    """Copy the pieces in ``src_dir`` (each checked) into the stash; returns the stashed paths
    (a piece already stashed with the same bytes is not copied again)."""
    dest_dir = dest_dir or stash_dir()
    done = []
    for piece in sorted(src_dir.glob("*.part-*-of-*")) if src_dir.is_dir() else []:
        header = check_piece(piece)
        dest = dest_dir / piece.name
        if not (dest.is_file() and read_header(dest)[0] == header):
            _write_atomic(dest, lambda f, p=piece: _copy_range(p, f, 0, p.stat().st_size))
        done.append(dest)
    return done


def join(name: str, dest: Path, dirs: list[Path]) -> Path:
    """The whole file ``name`` at ``dest`` from its pieces found in ``dirs`` (the first
    directory that holds a piece wins); PieceError naming what is missing or wrong. ``dest``
    is written under a temp name and renamed once its sha256 matches."""
    found: dict[int, tuple[Path, Header]] = {}
    for d in dirs:
        for piece in sorted(d.glob(f"{name}.part-*-of-*")) if d.is_dir() else []:
            header = check_piece(piece)
            found.setdefault(header.index, (piece, header))
    if not found:
        raise PieceError(f"no piece of {name} in {', '.join(map(str, dirs))}: carry {name}.part-I-of-N "
                         "(tools/bench/device_pieces.py split)")
    headers = [h for _, h in found.values()]
    first = headers[0]
    if any((h.name, h.size, h.sha256, h.count) != (first.name, first.size, first.sha256, first.count)
           for h in headers):
        raise PieceError(f"pieces of {name} from two different files (whole sha256 or piece count differ); "
                         "remove the stale ones and carry one split's pieces")
    missing = [i for i in range(1, first.count + 1) if i not in found]
    if missing:
        raise PieceError(f"{name}: piece(s) {', '.join(piece_name(name, i, first.count) for i in missing)} not "
                         "carried yet (one piece per call)")

    def write(f):
        for i in range(1, first.count + 1):
            piece, header = found[i]
            _copy_range(piece, f, read_header(piece)[1], header.piece_size)

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.join-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        got = sha256_of(tmp)
        if got != first.sha256:
            raise PieceError(f"{name}: the joined file's sha256 {got[:16]}... differs from the pieces' "
                             f"{first.sha256[:16]}...; not used")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("split", help="cut FILE into pieces (here)")
    p.add_argument("file", type=Path)
    p.add_argument("--out", type=Path, required=True, help="an ignored folder, e.g. runs/carry")
    p.add_argument("--max-piece-mib", type=float, default=DEFAULT_MAX_PIECE_MIB)
    p = sub.add_parser("stash", help="keep the carried pieces of DIR outside the repository (there)")
    p.add_argument("dir", type=Path)
    p = sub.add_parser("join", help="the whole file from its stashed (or carried) pieces (there)")
    p.add_argument("--name", required=True, help="the whole file's name")
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--from", dest="dirs", type=Path, action="append", default=[],
                   help="also look here (repeatable); the stash is always searched last")
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            for piece in split(args.file, args.out, args.max_piece_mib):
                print(f"{piece} ({piece.stat().st_size / 2**20:.1f} MiB)")
        elif args.command == "stash":
            stashed = stash(args.dir)
            print(f"stashed {len(stashed)} piece(s) in {stash_dir()}: {', '.join(p.name for p in stashed) or 'none'}")
        else:
            dest = join(args.name, args.dest, [*args.dirs, stash_dir()])
            print(f"joined {dest} ({dest.stat().st_size / 2**20:.1f} MiB, sha256 checked)")
    except (PieceError, OSError) as e:
        print(f"device_pieces: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
