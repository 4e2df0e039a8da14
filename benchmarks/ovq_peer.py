"""Time the OVQ attention of the KVM paper's public PyTorch code, ``model/ovq_mixer.py`` of a clone you give.

Usage (``bench_cpu.py --ovq-peer DIR --peer-python PY`` runs it, one process per call of this script)::

    PY benchmarks/ovq_peer.py DIR --T 16384 --dtype float64 --calls 3

``DIR`` is a clone of that repository; none of its code is in this project.
Its ``ovq_mixer.py`` is loaded from there unchanged.  The three modules it
imports for the layer class around the function (``utils.opt``,
``model.rwkv7_backbone``, ``model.value_residual_mixin``; the first cannot
be imported from the published repository, whose ``utils/__init__.py`` names a
file it does not contain) are given as empty stand-ins: ``ovq_attention``,
the function timed, uses none of them.

The call is the layer's own (``SequenceMixer.forward``) with its default
switches, which are this project's defaults too: ``chunk_size = 256``,
``max_centroids = 1024``, plateau growth (``use_min_state_size = False``),
the count bias (``use_counts_for_lr_only = False``), the running-mean update
(``use_delta_rule = False``), centroids not renormalised; one sequence and
one head, ``d = 64``, ``beta = 1`` (so the logits are scaled by
``sqrt(d)``, as :func:`refimpl.ovq.ovq_attention`'s default).  Queries and
keys are the unit rows of the same standard-normal draws as
``bench_cpu.py``'s (the layer normalises them before the call), under
``torch.no_grad()``, on the CPU threads PyTorch picks.  Prints one
``RESULT {json}`` line (:func:`isolated.time_calls`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from isolated import time_calls  # noqa: E402


def load(clone):
    """``model.ovq_mixer`` of the clone at ``clone``, its unused imports stood in for."""
    import torch

    def stand_in(name, **attrs):
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module

    class _Mixin(torch.nn.Module):
        pass

    stand_in("utils", __path__=[])
    stand_in("utils.opt", set_label=lambda label, module, *args: module)
    stand_in("model", __path__=[])
    stand_in("model.rwkv7_backbone", StatesDictCache=object, apply_rotary_embeddings=None)
    stand_in("model.value_residual_mixin", ValueResidualMixin=_Mixin)
    path = Path(clone) / "model" / "ovq_mixer.py"
    found = importlib.util.spec_from_file_location("model.ovq_mixer", path)
    module = importlib.util.module_from_spec(found)
    sys.modules["model.ovq_mixer"] = module
    found.loader.exec_module(module)
    return module


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("clone")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--calls", type=int, default=3)
    args = p.parse_args(argv)
    import torch

    mixer = load(args.clone)
    q, k, v = (torch.from_numpy(a) for a in np.random.default_rng(4).normal(size=(3, args.T, 64)).astype(args.dtype))
    q = (q / q.norm(dim=-1, keepdim=True))[None, None]
    k = (k / k.norm(dim=-1, keepdim=True))[None, None]
    v = v[None, None]
    beta = torch.ones(1, dtype=q.dtype)

    def call():
        with torch.no_grad():
            return mixer.ovq_attention(q, k, v, None, None, None, beta=beta, chunk_size=256, max_centroids=1024,
                                       normalize_centroids=False, use_min_state_size=False,
                                       use_counts_for_lr_only=False, use_delta_rule=False)

    import json

    print("RESULT " + json.dumps({**time_calls(call, args.calls), "torch": torch.__version__,
                                  "threads": torch.get_num_threads()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
