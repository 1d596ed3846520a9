#!/usr/bin/env bash
# The paper's Fig. 7: end-to-end time at 50% of the weights on the GPU (configs/fig7.toml).
#   experiments/fig7.sh           on a GPU machine: results/paper-<date>/fig7.csv, paper-figures/fig7.{png,svg}
#   experiments/fig7.sh --small   the CPU-only variant CI runs: results/paper-small-cpu/, paper-figures/small-cpu/
# Other flags and the environment: experiments/paper.py's header.
set -euo pipefail
exec python3 "$(dirname "$0")/paper.py" "$(dirname "$0")/../configs/fig7.toml" "$@"
