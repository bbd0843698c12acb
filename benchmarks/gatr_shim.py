"""Import shims that let GATr's own code run from a checkout in a plain PyTorch venv.

GATr imports a few packages at module level that its n-body GATr and Transformer runs never call:

* ``xformers.ops`` (``memory_efficient_attention``, ``AttentionBias``; ``fmha.BlockDiagonalMask`` for
  arteries). GATr calls xformers only when an attention mask is an ``AttentionBias`` or
  ``FORCE_XFORMERS`` is set; on n-body the mask is ``None`` and the flag is off, so every attention
  goes to ``torch.nn.functional.scaled_dot_product_attention`` already. The stub below implements the
  xformers entry points on SDPA anyway (block-diagonal masks materialised as boolean masks) and counts
  its calls, so a run can show it was not used.
* ``dgl`` (SE(3)-Transformer baseline), ``torch_scatter`` (SEGNN baseline), ``cliffordlayers``
  (GCA-GNN baseline): imported by ``gatr.experiments.nbody.wrappers``; no wheels for this torch.
* ``mlflow``: GATr's experiment tracking. The runner turns GATr's own switch
  (``gatr.utils.mlflow.LOGGING_ENABLED``) off and never starts a tracking run.

Each stub that is not xformers raises one clear ``RuntimeError`` naming itself if anything calls it.

Usable as a launcher for GATr's own scripts, e.g. its data generator::

    python benchmarks/gatr_shim.py --gatr /work/peers/gatr scripts/generate_nbody_dataset.py \\
        base_dir=/tmp/gatr seed=42 data.data_dir=/work/data/nbody-gatr
"""

from __future__ import annotations

import argparse
import runpy
import sys
import types
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

# Modules GATr imports that its n-body GATr / Transformer runs never use, and what needs them.
UNUSED_MODULES = {
    "dgl": "GATr's SE(3)-Transformer n-body baseline",
    "torch_scatter": "GATr's SEGNN n-body baseline",
    "cliffordlayers": "GATr's GCA-GNN / GCA-MLP n-body baselines",
    "cliffordlayers.cliffordalgebra": "GATr's GCA-GNN / GCA-MLP n-body baselines",
    "cliffordlayers.nn": "GATr's GCA-GNN / GCA-MLP n-body baselines",
    "cliffordlayers.nn.modules": "GATr's GCA-GNN / GCA-MLP n-body baselines",
    "cliffordlayers.nn.modules.gcan": "GATr's GCA-GNN / GCA-MLP n-body baselines",
    "mlflow": "GATr's experiment tracking (kept off by the runner)",
}

# Calls that reached the xformers stub (0 on n-body: GATr attends through SDPA directly there).
XFORMERS_CALLS = 0


class AttentionBias:
    """Stand-in for ``xformers.ops.AttentionBias``: the base class GATr tests masks against."""

    def materialize(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        raise NotImplementedError


class BlockDiagonalMask(AttentionBias):
    """``xformers.ops.fmha.BlockDiagonalMask``: items of a packed batch attend only within their block.

    ``q_seqlen[i]`` queries of block i see the ``kv_seqlen[i]`` keys of block i (``kv_seqlen`` defaults to
    ``q_seqlen``); sequences are packed along the token axis of a batch of one, as in xformers.
    """

    def __init__(self, q_seqlen: Sequence[int], kv_seqlen: Sequence[int] | None = None):
        self.q_seqlen = [int(n) for n in q_seqlen]
        self.kv_seqlen = self.q_seqlen if kv_seqlen is None else [int(n) for n in kv_seqlen]
        if len(self.q_seqlen) != len(self.kv_seqlen):
            raise ValueError(
                f"BlockDiagonalMask: {len(self.q_seqlen)} query blocks but {len(self.kv_seqlen)} key blocks"
            )

    @classmethod
    def from_seqlens(cls, q_seqlen: Sequence[int],
                     kv_seqlen: Sequence[int] | None = None) -> BlockDiagonalMask:
        return cls(q_seqlen, kv_seqlen)

    def allowed(self, device: torch.device | None = None) -> torch.Tensor:
        """Boolean ``(Mq, Mk)`` mask, True where a query may attend to a key."""
        q_block = torch.repeat_interleave(torch.arange(len(self.q_seqlen), device=device),
                                          torch.tensor(self.q_seqlen, device=device))
        k_block = torch.repeat_interleave(torch.arange(len(self.kv_seqlen), device=device),
                                          torch.tensor(self.kv_seqlen, device=device))
        return q_block[:, None] == k_block[None, :]

    def materialize(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """Additive bias of ``shape`` (last two dims ``(Mq, Mk)``): 0 within a block, -inf across."""
        bias = torch.zeros(shape[-2:], dtype=dtype, device=device)
        bias.masked_fill_(~self.allowed(torch.device(device)), float("-inf"))
        return bias.expand(shape)


def memory_efficient_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               attn_bias: AttentionBias | torch.Tensor | None = None, p: float = 0.0,
                               scale: float | None = None) -> torch.Tensor:
    """xformers' attention on SDPA: ``query``, ``key``, ``value`` ``(B, M, H, K)`` -> ``(B, Mq, H, Kv)``.

    ``attn_bias``: None, a ``BlockDiagonalMask`` (boolean mask ``(Mq, Mk)``), or an additive float tensor
    broadcastable to ``(B, H, Mq, Mk)`` — SDPA's float-mask semantics are xformers' tensor-bias semantics.
    """
    global XFORMERS_CALLS
    XFORMERS_CALLS += 1
    if isinstance(attn_bias, BlockDiagonalMask):
        mask = attn_bias.allowed(query.device)
    elif isinstance(attn_bias, AttentionBias):
        raise NotImplementedError(f"xformers shim: no support for attention bias {type(attn_bias).__name__}")
    else:
        mask = attn_bias
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, M, K)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, scale=scale)
    return out.transpose(1, 2)


class _Unused(types.ModuleType):
    """A module GATr imports but never calls on this task: importing a name works, calling it is an error."""

    def __init__(self, name: str, needed_by: str):
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so that submodule imports resolve to stubs too
        self._needed_by = needed_by

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        message = f"{self.__name__}.{attr} is not installed here (only {self._needed_by} uses it)"

        def missing(*args, **kwargs):
            raise RuntimeError(message)

        return missing  # `from stub import Name` works; calling Name fails


def install(gatr_dir: str | Path) -> None:
    """Put the shims in ``sys.modules`` and GATr's checkout first on ``sys.path`` (before importing gatr)."""
    xformers = types.ModuleType("xformers")
    ops = types.ModuleType("xformers.ops")
    fmha = types.ModuleType("xformers.ops.fmha")
    for module in (ops, fmha):
        module.AttentionBias = AttentionBias
        module.BlockDiagonalMask = BlockDiagonalMask
        module.memory_efficient_attention = memory_efficient_attention
    ops.fmha = fmha
    xformers.ops = ops
    sys.modules.update({"xformers": xformers, "xformers.ops": ops, "xformers.ops.fmha": fmha})
    for name, needed_by in UNUSED_MODULES.items():
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = _Unused(name, needed_by)
    sys.path.insert(0, str(Path(gatr_dir).resolve()))


def check_gatr_checkout(gatr_dir: str | Path) -> str | None:
    """The one-line problem with a GATr checkout, or None when it has the package and its n-body config."""
    root = Path(gatr_dir)
    for needed in ("gatr/__init__.py", "gatr/experiments/nbody/experiment.py", "config/nbody.yaml"):
        if not (root / needed).is_file():
            return (f"no GATr checkout at {str(root)!r} (missing {needed}); "
                    "clone it first, see benchmarks/README.md")
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one of GATr's scripts (with its hydra overrides) under the shims."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gatr", required=True, help="GATr checkout")
    parser.add_argument("script", help="path inside the checkout, e.g. scripts/generate_nbody_dataset.py")
    parser.add_argument("overrides", nargs="*", help="hydra overrides passed to the script")
    args = parser.parse_args(argv)
    problem = check_gatr_checkout(args.gatr)
    script = Path(args.gatr) / args.script
    if problem is None and not script.is_file():
        problem = f"no script {str(script)!r} in the GATr checkout"
    if problem:
        print(f"gatr_shim: {problem}", file=sys.stderr)
        return 2
    install(args.gatr)
    sys.argv = [str(script), *args.overrides]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
