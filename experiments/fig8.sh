#!/usr/bin/env bash
# The paper's Fig. 8: TTFT against prompt length (32-512) (configs/fig8.toml).
#   experiments/fig8.sh           on a GPU machine: results/paper-<date>/fig8.csv, paper-figures/fig8.{png,svg}
#   experiments/fig8.sh --small   the CPU-only variant CI runs: results/paper-small-cpu/, paper-figures/small-cpu/
# Other flags and the environment: experiments/paper.py's header.
set -euo pipefail
exec python3 "$(dirname "$0")/paper.py" "$(dirname "$0")/../configs/fig8.toml" "$@"
