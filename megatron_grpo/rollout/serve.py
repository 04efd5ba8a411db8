"""`megatron-grpo serve`: run the embedded rollout engine as an SGLang-compatible HTTP server.

    megatron-grpo serve --model-dir HF_DIR --host 127.0.0.1 --port PORT [--api-key KEY]

Binds loopback by default (anything else exposes the weight-update routes to the network;
use --api-key then). Also started by the trainer as ``python -m megatron_grpo.rollout.serve``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

import torch
import uvicorn

from megatron_grpo.rollout.embedded.engine import EmbeddedEngine
from megatron_grpo.ops.quantize import FP8_DTYPES, scheme_of
from megatron_grpo.rollout.embedded.server import build_app
from megatron_grpo.rollout.engines.embedded import API_KEY_ENV


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megatron-grpo serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="Hugging Face model directory to serve")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port (default: 30000)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   f"(default: ${API_KEY_ENV}, which keeps the key out of `ps`)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="parameter dtype (auto: the checkpoint's)")
    p.add_argument("--quantization", default=None, choices=["fp8", "int8"],
                   help="serve the decoder's attention and MLP projections quantized: fp8 (weights per output "
                        "channel, activations per token) or int8 (weights only); default: as loaded")
    p.add_argument("--fp8-format", default="e4m3", choices=sorted(FP8_DTYPES),
                   help="float8 format of --quantization fp8 (e5m2: fewer mantissa bits, a larger mismatch)")
    p.add_argument("--device", default="auto", help="where the model runs: auto (the GPU when CUDA is available, "
                   "else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded together (the running batch)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without sampling_seed")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print(f"megatron-grpo serve: --model-dir {args.model_dir}: no config.json (not a Hugging Face "
              "model directory)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = EmbeddedEngine(args.model_dir, dtype=args.dtype, max_batch_size=args.max_batch_size, seed=args.seed,
                            device=args.device, quantization=scheme_of(args.quantization, args.fp8_format))
    app = build_app(engine, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None)
    print(f"megatron-grpo serve: {args.model_dir} on http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
