#!/usr/bin/env bash
# The series task's peers in their own venv beside the repository: PyPOTS (GRU-D, BRITS, Raindrop)
# and torchcde (Neural CDE), run by benchmarks/series_peers.py.
#
#   bash benchmarks/setup_series_peers.sh [PEERS_DIR]     # default: ../peers next to the repository
#
# torch is pinned and installed first, and every later line pins it again, so no dependency swaps
# in another torch build (a bare `torch` requirement resolves to a multi-GB CUDA build).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peers="${1:-$(dirname "$repo")/peers}"
venv="$peers/pypots-venv"
python="${PYTHON:-python3}"
torch="torch==2.13.0"

mkdir -p "$peers"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet "$torch"
# torch_geometric for Raindrop's graph layers; its torch_scatter and torch_sparse have no build for
# this torch, so benchmarks/series_peers.py maps them onto torch_geometric's own scatter
"$venv/bin/pip" install --quiet "$torch" pypots torchcde torch_geometric
"$venv/bin/python" - <<'PY'
import pypots, torch, torch_geometric, torchcde
from pypots.classification import BRITS, GRUD, Raindrop  # noqa: F401
print(f"pypots {pypots.__version__}, torchcde {torchcde.__version__}, "
      f"torch_geometric {torch_geometric.__version__}, torch {torch.__version__}")
PY
