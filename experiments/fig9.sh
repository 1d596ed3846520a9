#!/usr/bin/env bash
# The paper's Fig. 9: TPOT against generated tokens (32/64/128) (configs/fig9.toml).
#   experiments/fig9.sh           on a GPU machine: results/paper-<date>/fig9.csv, paper-figures/fig9.{png,svg}
#   experiments/fig9.sh --small   the CPU-only variant CI runs: results/paper-small-cpu/, paper-figures/small-cpu/
# Other flags and the environment: experiments/paper.py's header.
set -euo pipefail
exec python3 "$(dirname "$0")/paper.py" "$(dirname "$0")/../configs/fig9.toml" "$@"
