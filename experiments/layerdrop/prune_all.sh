#!/usr/bin/env bash
# Scores every run of the study (after train_all.sh; waits for runs still training): LayerDrop
# runs pruned with every strategy to 2, 3, 4 of 6 layers per stack (seed 1; the plot) or to 3
# (seed 2; the half-depth table needs both seeds, the budget not more), DropHead runs unpruned.
# Greedy decoding of the first 200 valid / test sentences, outputs capped at |src| + 20 tokens
# (undertrained models babble up to the cap; the cap bounds decoding time, not the scores of
# sentences that end earlier). Writes outputs/layerdrop/<run>/prune/prune.{md,csv,json,png}.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
COMMON=(--beam 1 --max-len-b 20 --max-sentences 200 --quiet)
for seed in ${SEEDS:-1 2}; do  # SEEDS="2" to run one seed (e.g. two workers in parallel)
  for arm in ld0 ld0.2 ld0.5 ld0.5learned dh_const dh_vshape; do
    dir=outputs/layerdrop/${arm}-s${seed}
    while [ ! -f "$dir/results.json" ]; do sleep 20; done
    [ -f "$dir/prune/prune.json" ] && { echo "skip $dir"; continue; }
    case $arm in
      ld*) $PY -m normlab.commands.prune "$dir" --depths "$([ "$seed" = 1 ] && echo 2,3,4 || echo 3)" "${COMMON[@]}" ;;
      dh*) $PY -m normlab.commands.prune "$dir" --strategies "" "${COMMON[@]}" ;;
    esac
  done
done
