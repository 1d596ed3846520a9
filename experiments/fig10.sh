#!/usr/bin/env bash
# The paper's Fig. 10: TTFT and TPOT at 25/50/75% of the weights on the GPU (configs/fig10.toml).
#   experiments/fig10.sh           on a GPU machine: results/paper-<date>/fig10.csv, paper-figures/fig10.{png,svg}
#   experiments/fig10.sh --small   the CPU-only variant CI runs: results/paper-small-cpu/, paper-figures/small-cpu/
# Other flags and the environment: experiments/paper.py's header.
set -euo pipefail
exec python3 "$(dirname "$0")/paper.py" "$(dirname "$0")/../configs/fig10.toml" "$@"
