#!/usr/bin/env bash
# One node, all GPUs: the rollout server (SGLang, launched by rank 0 per engine.kind) and
# the trainer ranks share the machine.
#   bash launch/single_node.sh yaml_configs/qwen2.5_0.5b_gsm8k.yaml [section.key=value ...]
# NPROC defaults to parallel.world_size of the config (else tp*pp). Pre-flight, rank
# start-up and one-line errors are `megatron-grpo train`'s.
set -euo pipefail
CONFIG="${1:?usage: single_node.sh CONFIG [overrides...]}"; shift
nproc=()
if [[ -n "${NPROC:-}" ]]; then nproc=(--nproc "$NPROC"); fi
exec megatron-grpo train --config "$CONFIG" "${nproc[@]}" "$@"
