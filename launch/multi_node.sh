#!/usr/bin/env bash
# Several nodes. Run this on every trainer node with the same MASTER_ADDR/NNODES and its own
# NODE_RANK. The rollout server either runs on its own node (start it there with
# `python -m sglang.launch_server ... --host 0.0.0.0` and pass rollout.urls='[http://HOST:PORT]')
# or is launched by global rank 0 (rollout.engine: sglang), colocated with the trainer.
#   MASTER_ADDR=10.0.0.1 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 \
#     bash launch/multi_node.sh yaml_configs/qwen2.5_7b_gsm8k.yaml rollout.urls='[http://10.0.0.9:30000]'
set -euo pipefail
CONFIG="${1:?usage: multi_node.sh CONFIG [overrides...]}"; shift
# (no apostrophe inside ${VAR:?...}: bash reads it as an opening quote and the script stops parsing)
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
MASTER_PORT="${MASTER_PORT:-29500}"
megatron-grpo validate-config "$CONFIG" "$@" --world-size $((NNODES * NPROC_PER_NODE)) > /dev/null
exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  -m megatron_grpo.train --config "$CONFIG" "$@"
