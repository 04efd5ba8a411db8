"""`megatron-grpo serve`: run the embedded rollout engine as an SGLang-compatible HTTP server.

    megatron-grpo serve --model-dir HF_DIR --host 127.0.0.1 --port PORT [--api-key KEY]

Binds loopback by default. Any other address exposes the weight-update routes to the network,
so it needs an API key (--api-key or $MEGATRON_GRPO_API_KEY): without one the server refuses to
start. Also started by the trainer as ``python -m megatron_grpo.inference.serve``,
with the request bounds of ``engine.embedded``, the run's weight-sync directory as a trusted
weight directory and the run's weight-update master address (``inference/limits.py``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

import torch
import uvicorn

from megatron_grpo.inference.engine import EmbeddedEngine
from megatron_grpo.inference.static_decode import DECODE_MODES
from megatron_grpo.ops.quantize import FP8_DTYPES, scheme_of
from megatron_grpo.inference.limits import (DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_REQUEST_SEQUENCES,
                                         DEFAULT_MAX_REQUEST_TOKENS, DEFAULT_READ_TIMEOUT_S, RequestLimits)
from megatron_grpo.chat.tool_calls import TOOL_CALL_FORMATS
from megatron_grpo.runtime.http_guard import header_deadline_protocol
from megatron_grpo.inference.server import build_app, http_error_body
from megatron_grpo.generation.adapters.embedded import API_KEY_ENV
from megatron_grpo.runtime.placement import is_loopback


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
    p.add_argument("--decode", default="eager", choices=list(DECODE_MODES),
                   help="eager (the host reads every token) or static (static caches, device sampling, CUDA "
                        "graphs on a GPU; inference/static_decode.py)")
    p.add_argument("--stop-check-every", type=int, default=8, metavar="K",
                   help="--decode static: tokens drawn between two host reads (default: 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without sampling_seed")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body in bytes; larger ones are a 413 (default: %(default)s)")
    p.add_argument("--max-request-sequences", type=int, default=DEFAULT_MAX_REQUEST_SEQUENCES,
                   help="most sequences (inputs x n) one /generate may ask for (default: %(default)s)")
    p.add_argument("--max-request-tokens", type=int, default=DEFAULT_MAX_REQUEST_TOKENS,
                   help="most tokens one /generate may put in flight: per sequence its prompt plus "
                        "max_new_tokens (default: %(default)s)")
    p.add_argument("--trusted-weight-dir", action="append", default=[], metavar="DIR",
                   help="a directory /update_weights_from_disk may load from (repeatable; the model "
                        "directory always is); anything outside them is a 403")
    p.add_argument("--weight-sync-master-address", default=None, metavar="ADDR",
                   help="the one master address /init_weights_update_group may name (the trainer's "
                        "sync.master_address); default: loopback addresses only")
    p.add_argument("--read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="S",
                   help="deadline for a request's headers (from the connection's start or the previous answer) "
                        "and then for its body; a slower sender gets a 408 and the connection is closed")
    p.add_argument("--tool-call-format", default="hermes", choices=sorted(TOOL_CALL_FORMATS),
                   help="how /v1/chat/completions finds tool calls in a completion (default: hermes, "
                        "<tool_call>{json}</tool_call> as Qwen and Hermes templates ask)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        print(f"megatron-grpo serve: --model-dir {args.model_dir}: no config.json (not a Hugging Face "
              "model directory)", file=sys.stderr)
        return 2
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not is_loopback(args.host):
        print(f"megatron-grpo serve: --host {args.host} is reachable from the network and no API key is set: "
              f"give one with --api-key KEY or ${API_KEY_ENV} (or bind 127.0.0.1)", file=sys.stderr)
        return 2
    if args.stop_check_every < 1:
        print(f"megatron-grpo serve: --stop-check-every must be >= 1, got {args.stop_check_every}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:
        limits = RequestLimits(max_request_bytes=args.max_request_bytes,
                              max_request_sequences=args.max_request_sequences,
                              max_request_tokens=args.max_request_tokens,
                              trusted_weight_dirs=(args.model_dir, *args.trusted_weight_dir),
                              weight_sync_master_address=args.weight_sync_master_address,
                              read_timeout_s=args.read_timeout_s)
    except ValueError as e:
        print(f"megatron-grpo serve: {e}", file=sys.stderr)
        return 2
    engine = EmbeddedEngine(args.model_dir, dtype=args.dtype, max_batch_size=args.max_batch_size, seed=args.seed,
                            device=args.device, quantization=scheme_of(args.quantization, args.fp8_format),
                            decode=args.decode, stop_check_every=args.stop_check_every)
    app = build_app(engine, api_key=api_key, limits=limits, tool_call_format=args.tool_call_format)
    decode = ("" if args.decode == "eager" else f" (decode: static, the host reads the tokens every "
              f"{args.stop_check_every}; CUDA graphs {'on' if engine.device.type == 'cuda' else 'off: not CUDA'})")
    print(f"megatron-grpo serve: {args.model_dir} on http://{args.host}:{args.port}{decode}", flush=True)
    try:
        # h11 with a deadline on the headers too (runtime/http_guard.py); the body's is the route's
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    http=header_deadline_protocol(args.read_timeout_s, "--read-timeout-s", http_error_body))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
