"""The supervised *format* warm-up step that the demo's and the benchmarks' tiny models share
(``tools/make_demo_model.py``, ``tools/bench_throughput.py``): each builds its own
(prompt, response) rows; the step itself is the same."""

from __future__ import annotations

import torch


def supervised_step(model, opt: torch.optim.Optimizer, rows: list[tuple[list[int], list[int]]],
                    pad_id: int) -> torch.Tensor:
    """One optimizer step of next-token loss on the response tokens of ``rows``.

    rows: N (prompt ids, response ids) pairs; each row is right-padded with ``pad_id`` to the
    longest prompt + response, ids/labels [N, W], labels -100 outside the response. Returns
    the (detached) loss.
    """
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, r) in enumerate(rows):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p) : len(p) + len(r)] = torch.tensor(r)
    loss = model(input_ids=ids, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.detach()
