#!/usr/bin/env bash
# Trains every arm of the LayerDrop / DropHead study (experiments/layerdrop/README.md), 2 seeds.
# Run folders: outputs/layerdrop/<arm>-s<seed>. One thread per run: the machine is shared.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
train() {  # arm seed overrides...
  local arm=$1 seed=$2; shift 2
  local dir=outputs/layerdrop/${arm}-s${seed}
  if [ -f "$dir/results.json" ]; then echo "skip $dir (done)"; return; fi
  $PY train.py experiment=layerdrop seed="$seed" name="${arm}-s${seed}" hydra.run.dir="$dir" "$@"
}
for seed in 1 2; do
  train ld0 "$seed" regularizer=none
  train ld0.2 "$seed" regularizer=layerdrop regularizer.encoder_layerdrop=0.2 regularizer.decoder_layerdrop=0.2
  train ld0.5 "$seed" regularizer=layerdrop regularizer.encoder_layerdrop=0.5 regularizer.decoder_layerdrop=0.5
  train ld0.5learned "$seed" regularizer=layerdrop regularizer.encoder_layerdrop=0.5 \
    regularizer.decoder_layerdrop=0.5 regularizer.layerdrop_rates=learned
  train dh_const "$seed" regularizer=drophead regularizer.drophead=0.2 callbacks.drophead_schedule.schedule=constant
  train dh_vshape "$seed" regularizer=drophead regularizer.drophead=0.2 callbacks.drophead_schedule.schedule=v_shape
done
