#!/usr/bin/env bash
# One node, all GPUs: the rollout server (SGLang, launched by rank 0 per rollout.engine) and
# the trainer ranks share the machine.
#   bash launch/single_node.sh yaml_configs/qwen2.5_0.5b_gsm8k.yaml [section.key=value ...]
# NPROC defaults to parallel.world_size of the config.
set -euo pipefail
CONFIG="${1:?usage: single_node.sh CONFIG [overrides...]}"; shift
NPROC="${NPROC:-$(python -c "import sys,yaml; c=yaml.safe_load(open(sys.argv[1])); p=c.get('parallel',{}); print(p.get('world_size') or p.get('tp',1)*p.get('pp',1))" "$CONFIG")}"
megatron-grpo validate-config "$CONFIG" "$@" --world-size "$NPROC" > /dev/null
exec torchrun --standalone --nproc_per_node="$NPROC" -m megatron_grpo.train --config "$CONFIG" "$@"
