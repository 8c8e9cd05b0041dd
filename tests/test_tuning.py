"""TUNED lookups: the measured shape, else the nearest measured one within 2x (kernels/tuning.py)."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.kernels import fused_linear
from specpilot.kernels.tuning import MAX_RATIO, nearest_tuned
from specpilot.kernels.u12 import dispatch as u12_linear

QWEN3_8B = {"gate_up": (24576, 4096, True), "down": (4096, 12288, False)}  # N (2I when gated), K


def test_measured_shapes_take_their_own_entry():
    for key, cfg in fused_linear.TUNED.items():
        assert nearest_tuned(fused_linear.TUNED, key) is cfg
        assert fused_linear.default_config(key[0], key[1], key[2], key[3]) is cfg
    for key, cfg in u12_linear.TUNED.items():  # M = 4: gemv2's entries (the tensor-core kernels take 3..4 rows)
        assert (u12_linear.gemv_config if key[0] == 4 else u12_linear.default_config)(*key) is cfg


def test_qwen3_8b_layers_take_llama_3_1_8b_configs():
    """Qwen3-8B's gate_up and down at every M bucket: Llama-3.1-8B's gate_up and down entries."""
    for m in (1, 4, 16):
        n, k, gated = QWEN3_8B["gate_up"]
        assert fused_linear.default_config(m, n, k, gated) is fused_linear.TUNED[(m, 28672, 4096, True)]
        n, k, gated = QWEN3_8B["down"]
        assert fused_linear.default_config(m, n, k, gated) is fused_linear.TUNED[(m, 4096, 14336, False)]
    for m in (1, 4, 16, 32, 64):
        pick = u12_linear.gemv_config if m == 4 else u12_linear.default_config
        assert pick(m, 24576, 4096) is u12_linear.TUNED[(m, 28672, 4096)]
        assert pick(m, 4096, 12288) is u12_linear.TUNED[(m, 4096, 14336)]
        assert pick(m, 151936, 4096) is u12_linear.TUNED[(m, 128256, 4096)]  # lm_head
        if m == 4:
            assert u12_linear.default_config(m, 4096, 12288) is u12_linear.TUNED[(16, 4096, 14336)]


LLAMA_U12 = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))


def test_u12_tensor_core_kernels_take_three_and_four_rows(monkeypatch):
    """From TENSOR_CORE_ROWS (3) to 4 rows u12_linear takes the 16-row tensor-core configs, below it
    gemv2; a few-row tensor-core entry first where TUNED has one; shapes without tensor-core entries
    keep gemv2."""
    tuned = u12_linear.TUNED
    for n, k in LLAMA_U12:
        assert u12_linear.default_config(3, n, k) is u12_linear.default_config(4, n, k) is tuned[(16, n, k)]
        assert tuned[(16, n, k)].kernel in ("mma", "hmma")
        assert u12_linear.default_config(2, n, k).kernel == "gemv2"
        assert u12_linear.default_config(1, n, k) is tuned[(1, n, k)]
    assert u12_linear.default_config(4, 768, 256).kernel == "gemv2"  # the zoo's size: nothing measured near
    few = u12_linear.U12Config(32, 32, split_k=2, num_warps=1, num_stages=1, kernel="hmma")
    monkeypatch.setitem(tuned, (4, 4096, 4096), few)
    assert u12_linear.default_config(4, 4096, 4096) is few
    assert u12_linear.gemv_config(4, 4096, 4096).kernel == "gemv2"  # not the few-row hmma entry


def test_far_shapes_and_other_flags_take_the_heuristic():
    # the zoo's hidden size: nothing measured within 2x
    assert nearest_tuned(fused_linear.TUNED, (1, 768, 256, False)) is None
    assert fused_linear.default_config(1, 768, 256, False) not in fused_linear.TUNED.values()
    # an ungated layer of gate_up's size: the gated entries do not serve it, the others are 4x away
    assert nearest_tuned(fused_linear.TUNED, (1, 24576, 4096, False)) is None
    # an M bucket the table lacks
    assert nearest_tuned(fused_linear.TUNED, (2, 6144, 4096, False)) is None


@settings(max_examples=200, deadline=None)
@given(m=st.sampled_from([1, 2, 4, 16, 32, 64]), n=st.integers(1, 300_000), k=st.integers(1, 40_000),
       gated=st.booleans())
def test_a_neighbour_shares_the_bucket_and_flags_and_is_nearest_within_the_ratio(m, n, k, gated):
    key = (m, n, k, gated)
    cfg = nearest_tuned(fused_linear.TUNED, key)
    qualifying = {other: math.log2(max(other[1] / n, n / other[1])) + math.log2(max(other[2] / k, k / other[2]))
                  for other in fused_linear.TUNED
                  if other[0] == m and other[3] == gated
                  and max(other[1] / n, n / other[1]) <= MAX_RATIO and max(other[2] / k, k / other[2]) <= MAX_RATIO}
    if not qualifying:
        assert cfg is None
    else:
        nearest = min(qualifying.values())
        assert any(fused_linear.TUNED[o] is cfg and d == nearest for o, d in qualifying.items())
