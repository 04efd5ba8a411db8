"""Per-tensor checksums that the trainer and the engine compute independently and compare.

The checksum of a tensor is a function of its exact bytes (dtype and values), computed in
one pass at memory speed: the bytes are read as int64 words, summed in blocks of
``BLOCK_WORDS`` words (512 bytes), and the block sums are combined with odd position
weights, all modulo 2**64. A changed word changes it; so does moving data between blocks
(a permutation of TP shards or of rows longer than a block, a transposed matrix, an
offset-by-one bucket slice), which a plain sum would miss. Reordering inside one 512-byte
block is not detected (a deliberate trade: it keeps the pass as fast as a plain sum).

It is not a cryptographic hash; it guards against sync bugs (wrong name mapping, stale or
partial updates, corrupted buckets), not against an adversary.
"""

from __future__ import annotations

import torch

BLOCK_WORDS = 64
_MASK64 = (1 << 64) - 1


def tensor_checksum(tensor: torch.Tensor) -> str:
    """Checksum of ``tensor``'s bytes as 16 hex digits (any dtype and shape; computed on the
    tensor's own device, only the result moves)."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    num_words = flat.numel() // 8
    words = flat[: num_words * 8].view(torch.int64)
    num_blocks = num_words // BLOCK_WORDS
    total = 0
    if num_blocks:
        block_sums = words[: num_blocks * BLOCK_WORDS].view(num_blocks, BLOCK_WORDS).sum(dim=1)
        weights = torch.arange(1, 2 * num_blocks, 2, dtype=torch.int64, device=flat.device)  # odd: invertible mod 2**64
        total = int((block_sums * weights).sum())
    tail_words = words[num_blocks * BLOCK_WORDS:]
    if tail_words.numel():
        total += int(tail_words.sum()) * (2 * num_blocks + 1)
    tail_bytes = flat[num_words * 8:]
    if tail_bytes.numel():
        total += int.from_bytes(bytes(tail_bytes.cpu().tolist()), "little") * (2 * num_blocks + 3)
    total += flat.numel() << 32  # the length, so trailing zero bytes are not invisible
    return f"{total & _MASK64:016x}"


def compare_checksums(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Names whose checksums differ or are missing on the engine side, sorted."""
    return sorted(name for name, value in expected.items() if actual.get(name) != value)
