#!/usr/bin/env bash
# Several nodes. Run this on every trainer node with the same MASTER_ADDR/NNODES and its own
# NODE_RANK; node 0 hosts the rendezvous and global rank 0. The run directory (checkpoints)
# must be on a filesystem every node shares. The rollout server either
#  * is launched by global rank 0 (engine.kind), colocated with the trainer on node 0, or
#  * runs on its own node: start it there first (`python -m sglang.launch_server ...
#    --host 0.0.0.0 --api-key KEY`, or `MEGATRON_GRPO_API_KEY=KEY megatron-grpo serve --model-dir DIR
#    --host 0.0.0.0`, which refuses a non-loopback address without a key) and pass
#    engine.urls='[http://HOST:PORT]' and engine.api_key=KEY on every node. On another machine than node 0 it needs
#    sync.transport=disk and the run directory at the same path there (the
#    default distributed sync's store listens on 127.0.0.1 of node 0).
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=4 \
#     bash launch/multi_node.sh yaml_configs/qwen2.5_7b_gsm8k.yaml engine.urls='[http://10.0.0.9:30000]' \
#     sync.transport=disk
# NPROC_PER_NODE (ranks on this node) defaults to parallel.world_size / NNODES; MASTER_PORT
# to 29500. Pre-flight, rank start-up and one-line errors are `megatron-grpo train`'s.
set -euo pipefail
CONFIG="${1:?usage: multi_node.sh CONFIG [overrides...]}"; shift
# (no apostrophe inside ${VAR:?...}: bash reads it as an opening quote and the script stops parsing)
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}"
nproc=()
if [[ -n "${NPROC_PER_NODE:-}" ]]; then nproc=(--nproc "$NPROC_PER_NODE"); fi
exec megatron-grpo train --config "$CONFIG" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" "${nproc[@]}" "$@"
