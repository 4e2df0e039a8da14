"""The positional-recall diagnosis: its decomposition of OVQ's outputs and its variants."""

import numpy as np
import pytest

from app.experiments import positional as pos
from app.experiments import recall


def test_the_decomposition_recovers_known_weights_of_the_right_and_older_values():
    task = recall.make_task("positional", 512, seed=2)
    P = task["values"].shape[0] // recall.SEGMENTS
    out = []
    for y in task["targets"]:
        older = [s * P + task["base"][y] for s in range(recall.SEGMENTS) if s * P + task["base"][y] != y]
        out.append(0.6 * task["values"][y] + 0.25 * task["values"][older[0]] + 0.05 * task["values"][older[2]])
    a, b = pos.decompose(np.array(out), task)
    assert a == pytest.approx(0.6, abs=1e-12) and b == pytest.approx(0.30, abs=1e-12)


def test_the_last_segment_alone_reads_the_same_queries_and_ovq_recalls_them():
    full = pos.run_point({"T": 512, "variant": "ovq", "seed": 0})
    alone = pos.run_point({"T": 512, "variant": "last_segment_only", "seed": 0})
    # with no earlier binding of a base key, nothing older can be blended in
    assert alone["accuracy"] == 1.0 and abs(alone["older_weight"]) < 0.05
    assert full["older_weight"] > 0.1


def test_every_variant_changes_one_switch_and_an_unknown_one_is_refused():
    assert set(pos.VARIANTS) >= {"ovq", "last_segment_only", "rate_0.3", "no_count_bias", "random_init", "capacity_x2"}
    assert pos.VARIANTS["ovq"] == ({}, 1, False)
    assert all(len(options) <= 2 for options, _, _ in pos.VARIANTS.values())
    with pytest.raises(ValueError, match="variant: expected one of"):
        pos.run_point({"T": 256, "variant": "ovq_fast", "seed": 0})
    points = pos.grid(True, 2)
    assert len(points) == len(pos.QUICK_T) * len(pos.VARIANTS) * 2
