"""The cost model: arithmetic on cases computable by hand, the acceptance model, gap ranking,
calibration records, the GPU database, and the report (table, PNG). No timed tests."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.cost import (
    GPU, AcceptanceModel, CostModel, Estimate, Figure, NodeCost, SpecStep, StepEstimate, Workload, alpha_for_tau,
    explain, gpu_names, load_gpu, matmul_weight_bytes, plot_gaps, render_table, step_time, tau_for_alpha,
    weight_footprint,
)
from specpilot.cost.gaps import CEILING_BEAM, Reached, pipeline_string, search_ceiling
from specpilot.cost.model import calibration_files, gpu_key, parse_records
from specpilot.dsl import parse_pipeline
from specpilot.cost.roofline import (
    KERNELS, SPLIT_KV_KERNELS, U12_ESCAPE_BYTES, U12_ESCAPE_RATE, U12_MAX_LANES, u12_lanes,
)
from specpilot.errors import SpecError
from specpilot.ir import MATMUL_OPS, Graph, Node, Program, lower
from specpilot.passes import run_passes
from specpilot.passes.fused_decoder import FusedDecoder
from specpilot.passes.tree_verify import TreeVerify
from specpilot.passes.weights_u12 import WeightsU12
from specpilot.passes.what_if import what_ifs
from specpilot.formats.u12 import MAX_LANES, pack_u12
from specpilot.hf.known import dflash_config, model_config

LLAMA_8B = model_config("llama-3.1-8b")
DFLASH_8B = dflash_config("llama-3.1-8b")
# Small enough to cost quickly, large enough that weights-u12 (min-numel 2^20) applies.
SMALL = dict(model_type="llama", vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-5, rope_theta=10000.0)
SMALL_DFLASH = dict(model_type="qwen3", rope_theta=10000.0, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=128, target_layer_ids=[0, 1], block_size=8, mask_token_id=4095)
SMALL_SHAPE = "llama-2x1024-v4096"

# A card with round numbers: 1 TB/s, 100 TFLOP/s bf16, 10 TFLOP/s fp32, perfect kernels, no latencies;
# one SM, so that attention always fills the card.
ROUND = GPU(name="round", full_name="round numbers", bandwidth=1e12, bf16_rate=1e14, fp32_rate=1e13, sms=1,
            l2_bytes=0.0, memory_bytes=80e9)


@pytest.fixture(scope="module")
def llama8b() -> Program:
    return lower(LLAMA_8B, DFLASH_8B, dtype="bfloat16")


@pytest.fixture(scope="module")
def small() -> Program:
    return lower(SMALL, SMALL_DFLASH, dtype="bfloat16")


def one_linear(n=4096, k=4096, fmt="bfloat16", kernel="torch") -> Graph:
    g = Graph("target")
    x = g.add("x", Node.make("input", what="tokens"))
    g.add("proj", Node.make("linear", in_features=k, out_features=n, dtype="bfloat16", format=fmt, kernel=kernel,
                            weight="w"), [x])
    return g


def to_u12(program: Program, kernel: str | None = None) -> Program:
    """What a weight pass does: every matmul's format -> u12 (via Graph.map_nodes)."""
    def fn(_, node):
        if node.op in MATMUL_OPS:
            return node.replace(format="u12", **({"kernel": kernel} if kernel else {}))
        return None

    for level in ("target", "drafter"):
        program = program.with_graph(level, program.graph(level).map_nodes(fn)[0])
    return program


# -- the GPU database

def test_every_gpu_loads_with_sources():
    names = gpu_names()
    for want in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "l40s", "rtx-4090", "b200"):
        assert want in names
    for name in names:
        gpu = load_gpu(name)
        assert gpu.bandwidth > 0 and gpu.bf16_rate > 0 and gpu.sms > 0 and gpu.note
        assert gpu.source_of("bandwidth") in ("measured", "published")


def test_h200_uses_measured_figures():
    gpu = load_gpu("H200")
    assert gpu.bandwidth == 4.06e12 and gpu.source_of("bandwidth") == "measured"
    assert gpu.bf16_rate == 790e12 and gpu.source_of("bf16_rate") == "measured"
    assert load_gpu("h100-sxm").source_of("bandwidth") == "published"


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(SpecError) as err:
        load_gpu("v100")
    assert "v100" in str(err.value) and "h200" in str(err.value) and "rtx-4090" in str(err.value)


# -- the roofline step model, by hand

def test_one_linear_by_hand():
    bf16_weight = 2 * 4096 * 4096
    activations = 2 * (4096 + 4096)  # one row in, one row out
    est = step_time(one_linear(), ROUND, batch=1, q=1, cache_len=0, cuda_graphs=True)
    assert est.bytes == bf16_weight + activations
    assert est.flops == 2 * 4096 * 4096
    assert est.time == pytest.approx((bf16_weight + activations) / 1e12)
    assert est.floor == pytest.approx(est.time)

    half = ROUND.with_(bw_efficiency=0.5)
    assert step_time(one_linear(), half, q=1).time == pytest.approx(2 * (bf16_weight + activations) / 1e12)


def test_compute_bound_linear_and_launch_overhead():
    q = 4096
    est = step_time(one_linear(), ROUND, batch=1, q=q, cuda_graphs=True)
    assert est.time == pytest.approx(2 * 4096 ** 3 / 1e14)  # FLOPs / rate > bytes / bandwidth
    assert est.rows[1].bound == "compute"
    launching = ROUND.with_(launch_s=5e-6)
    eager = step_time(one_linear(), launching, q=1, cuda_graphs=False)
    graphed = step_time(one_linear(), launching, q=1, cuda_graphs=True)
    assert eager.time - graphed.time == pytest.approx(5e-6)  # one kernel, no launch under CUDA graphs
    assert graphed.launch == 0.0


def test_u12_weights_are_twelve_bits_plus_escapes():
    bf16 = Node.make("linear", in_features=4096, out_features=6144, dtype="bfloat16", format="bfloat16",
                     kernel="torch", weight="w")
    u12 = bf16.replace(format="u12")
    planes, escapes = matmul_weight_bytes(u12, escape_rate=0.0)
    assert planes == pytest.approx(matmul_weight_bytes(bf16)[0] * 12 / 16)
    assert escapes == 4 * 6144  # one empty lane a row
    _, escapes = matmul_weight_bytes(u12, escape_rate=U12_ESCAPE_RATE)  # N(0, 0.02): 5 at most a row
    assert escapes == 4 * 6144 * 8
    _, escapes = matmul_weight_bytes(u12, escape_rate=3e-3)  # 12 a row on average: past 16 lanes
    assert escapes == pytest.approx(4096 * 6144 * 3e-3 * U12_ESCAPE_BYTES + 4 * 6145)


def test_u12_lanes_match_packed_weights():
    """The cost model's lanes a row against U12Tensor.esc_lanes on N(0, 0.02) weights (its rate)."""
    assert U12_MAX_LANES == MAX_LANES
    g = torch.Generator().manual_seed(0)
    for n, k in ((512, 4096), (256, 14336)):
        t = pack_u12((0.02 * torch.randn(n, k, generator=g)).to(torch.bfloat16))
        assert u12_lanes(n, k, t.esc_idx.numel() / (n * k)) == t.esc_lanes.shape[1]
    assert u12_lanes(4096, 70000, 0.0) == 0  # a lane's column is 16 bits


def test_u12_program_reads_three_quarters_of_the_weight_bytes(llama8b):
    u12 = to_u12(llama8b)
    for graph, q in (("target", 16), ("drafter", 16)):
        a = step_time(llama8b.graph(graph), ROUND, q=q, escape_rate=0.0)
        b = step_time(u12.graph(graph), ROUND, q=q, escape_rate=0.0)
        mm_a = sum(r.weight_bytes for r in a.rows if r.op in MATMUL_OPS)
        mm_b = sum(r.weight_bytes for r in b.rows if r.op in MATMUL_OPS)
        assert mm_b == pytest.approx(mm_a * 12 / 16)


def test_llama8b_weight_bytes_match_the_checkpoint(llama8b):
    est = step_time(llama8b.target, load_gpu("h200"), q=1, cache_len=512)
    matmul = sum(r.weight_bytes for r in est.rows if r.op in MATMUL_OPS)
    assert matmul == pytest.approx(15.01e9, rel=1e-3)  # GPU-FACTS: 15.0 GB of linears + lm_head
    # The drafter reads the target's lm_head again every draft step; the footprint counts it once.
    draft = step_time(llama8b.drafter, load_gpu("h200"), q=16)
    head = [r for r in draft.rows if r.op == "lm_head"][0]
    assert head.weight_bytes == 128256 * 4096 * 2
    drafter_own = sum(r.weight_bytes for r in draft.rows if r.op in MATMUL_OPS) - head.weight_bytes
    assert weight_footprint(llama8b) == pytest.approx(16.06e9 + drafter_own + 4096 * 2 * (65 + 11), rel=1e-3)


def test_attention_reads_the_cache_and_split_kv_helps_long_caches(small):
    gpu = load_gpu("h200")
    short = step_time(small.target, gpu, q=1, cache_len=0)
    long = step_time(small.target, gpu, q=1, cache_len=8192)
    attn_short = sum(r.kv_bytes for r in short.rows if r.op == "attention")
    attn_long = sum(r.kv_bytes for r in long.rows if r.op == "attention")
    assert attn_long - attn_short == 2 * 8192 * 4 * 128 * 2 * 2  # layers x tokens x kv_heads x head_dim x (K,V) x bf16
    split = small.target.map_nodes(lambda _, n: n.replace(kernel="triton-split-kv") if n.op == "attention" else None)[0]

    def attention_time(graph, q):
        return sum(r.time for r in step_time(graph, gpu, q=q, cache_len=8192).rows if r.op == "attention")

    assert attention_time(split, 16) < attention_time(small.target, 16)
    # SDPA decodes split already: at q = 1 the kernel saves launches only (two against SDPA's five)
    layers = len(small.target.find("attention"))
    saved = (KERNELS["attention"] - SPLIT_KV_KERNELS) * (gpu.kernel_latency_s + gpu.launch_s) * layers  # no graphs
    assert attention_time(split, 1) == pytest.approx(attention_time(small.target, 1) - saved)


# -- a pass that cuts bytes lowers the prediction

def test_u12_lowers_the_prediction(llama8b):
    model = CostModel("h100-sxm")  # no measured u12 kernel: the format's bytes alone count
    w = Workload(tau=5.0)
    before, after = model.predict(llama8b, w), model.predict(to_u12(llama8b), w)
    assert after.t_verify.value < before.t_verify.value
    assert after.t_draft.value < before.t_draft.value
    assert after.t_token.value < before.t_token.value
    assert after.speedup.value > before.speedup.value
    assert after.t_ar.value == pytest.approx(before.t_ar.value)  # the AR baseline keeps bf16 weights


def test_a_slow_kernel_can_cost_more_than_its_bytes_save(small):
    slow = ROUND.with_(kernel_efficiency={"triton-u12": 0.5})
    base = step_time(small.target, slow, q=1)
    u12 = step_time(to_u12(small, kernel="triton-u12").target, slow, q=1)
    assert u12.time > base.time  # 0.75x the bytes at 0.5x the bandwidth
    assert u12.floor < base.floor


# -- speedup

def _step(what: str, seconds: float) -> StepEstimate:
    row = NodeCost(name="n", op="linear", rows=1, t_kernel=seconds)
    return StepEstimate(what, "g", 1, 1, 0, True, costs=(row,), counts=(1,), layout=(("n", 0),))


def test_speedup_formula_by_hand():
    accept = NodeCost(name="accept", op="accept", rows=1, t_kernel=0.5e-3)
    s = SpecStep(ar=_step("ar", 4e-3), draft=_step("draft", 1e-3), verify=_step("verify", 4.5e-3),
                 overhead_rows=(accept,), tau=3.0)
    assert s.t_spec == pytest.approx(6e-3)
    assert s.speedup == pytest.approx(3.0 * 4e-3 / 6e-3)  # = 2.0
    assert s.t_token == pytest.approx(2e-3)


def test_predicted_speedup_is_the_formula(small):
    e = CostModel(ROUND).predict(small, Workload(tau=4.0))
    assert e.tau.value == pytest.approx(4.0)
    t_spec = e.t_draft.value + e.t_verify.value + e.overhead.value
    assert e.speedup.value == pytest.approx(e.tau.value * e.t_ar.value / t_spec)
    assert {f.source for _, f in e.figures()} <= {"predicted", "measured"}


# -- the acceptance model

@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 24), frac=st.floats(0.0, 1.0))
def test_tau_alpha_round_trip(k, frac):
    tau = 1.0 + frac * k
    alpha = alpha_for_tau(tau, k)
    assert 0.0 <= alpha <= 1.0
    assert tau_for_alpha(alpha, k) == pytest.approx(tau, abs=1e-9)
    assert AcceptanceModel.from_tau(tau, k).tau_chain(k) == pytest.approx(tau, abs=1e-9)


def test_impossible_tau_is_an_error():
    with pytest.raises(SpecError):
        alpha_for_tau(17.5, 15)


def test_histogram_expectation_by_hand():
    m = AcceptanceModel.from_histogram([10, 20, 30, 40])  # steps that accepted 0, 1, 2, 3 drafted tokens
    assert m.alphas == pytest.approx((0.9, 0.7 / 0.9, 0.4 / 0.7))
    assert m.tau_chain(3) == pytest.approx(1 + (20 + 60 + 120) / 100)  # E[A] = 2
    assert m.tau_chain(1) == pytest.approx(1.9)
    assert m.tau_chain(10) == pytest.approx(3.0)  # unmeasured positions earn nothing
    assert m.source == "measured"


def test_best_first_tree_by_hand():
    m = AcceptanceModel.geometric(0.5, 4)  # rank r caught with 0.5 * 0.5^(r-1): 0.5, 0.25, ...
    assert m.expected_accepted_tree(1, 4) == pytest.approx(0.5)
    assert m.expected_accepted_tree(2, 4) == pytest.approx(0.75)  # (1) 0.5, then (2) or (1,1) at 0.25
    assert m.expected_accepted_tree(3, 4) == pytest.approx(1.0)
    assert m.expected_accepted_tree(4, 4, width=1) == pytest.approx(m.expected_accepted(4))  # width 1 = chain
    assert m.tau_tree(15, 4) > m.tau_chain(4)
    paths = [ranks for _, ranks in m.best_tree(20, 4)]
    assert all(p[:-1] in paths or len(p) == 1 for p in paths)  # every parent is in the tree


def test_tree_verify_raises_tau_in_the_model(small):
    model = CostModel(ROUND)
    chain = model.predict(small, Workload(tau=4.0))
    tree = model.predict(TreeVerify(budget=32, topk=4).apply(small).program, Workload(tau=4.0))
    assert tree.tau.value > chain.tau.value
    assert tree.t_verify.value > chain.t_verify.value  # 33 tokens verified instead of 8


# -- gaps

ONE_CHOICE = ("weights-u12", "cuda-graphs", "fused-decoder", "attention-split-kv")


def only(*names):
    """The passes' what-if provider limited to `names` (a cost model asked about those passes only)."""
    def provider(program, passes=None):
        return what_ifs(program, [n for n in names if passes is None or n in passes])
    return provider


def test_gaps_are_ranked_and_add_up_to_the_ceiling(llama8b):
    e = CostModel("h200").predict(llama8b, Workload(tau=6.0), what_ifs)
    savings = [g.saving for g in e.gaps]
    assert savings == sorted(savings, reverse=True) and all(s > 0 for s in savings)
    assert sum(savings) == pytest.approx(e.t_token.value - e.ceiling.t_token, rel=1e-6)
    passes = {g.pass_name for g in e.gaps}
    assert {"cuda-graphs", "tree-verify", "fused-decoder"} <= passes
    assert e.ceiling.speedup > e.speedup.value and e.ceiling.tau >= e.tau.value
    # every pass gap's pipeline element reproduces its pass, and the pipeline of them all runs
    for g in e.gaps:
        if g.pass_name:
            assert [p.name for p in parse_pipeline(g.pipeline)] == [g.pass_name]
    assert run_passes(llama8b, parse_pipeline(pipeline_string(e.gaps)))[0]


def test_without_what_ifs_there_are_no_pass_gaps_and_the_ceiling_is_the_program_at_its_floor(small):
    e = CostModel("h200").predict(small, Workload(tau=4.0))
    assert {g.pass_name for g in e.gaps} == {""}  # kernels below the roofline only
    assert e.ceiling.pipeline == "" and e.ceiling.t_token == pytest.approx(e.t_token.floor)
    assert e.gaps[0].saving == pytest.approx(e.t_token.value - e.t_token.floor)


def test_any_provider_of_what_ifs_names_the_gaps(small):
    """The cost model knows what-ifs only through their four properties: a provider from anywhere works."""
    @dataclasses.dataclass(frozen=True)
    class HandMade:
        pass_name: str = "hand-made-u12"
        pipeline: str = "hand-made-u12{x=1}"
        closes: str = "weight bytes, by hand"
        program: Program = dataclasses.field(default_factory=lambda: to_u12(small))

    heavy = ROUND.with_(bandwidth=1e9)  # weight bytes dominate: u12 saves a quarter of the time
    e = CostModel(heavy).predict(small, Workload(tau=4.0), lambda program, passes=None: (
        [HandMade()] if program is small and (passes is None or "hand-made-u12" in passes) else []))
    [gap] = [g for g in e.gaps if g.pass_name]
    assert (gap.what, gap.pipeline) == ("weight bytes, by hand", "hand-made-u12{x=1}")
    assert gap.saving == pytest.approx(e.t_token.value - CostModel(heavy).predict(to_u12(small), Workload(tau=4.0)).t_token.value)
    assert e.ceiling.pipeline == "hand-made-u12{x=1}"


def test_gap_order_follows_the_costs(small):
    w = Workload(tau=4.0)
    launches = CostModel(ROUND.with_(launch_s=1e-3, host_sync_s=1e-6)).predict(small, w, only(*ONE_CHOICE))
    assert launches.gaps[0].pass_name == "cuda-graphs"
    syncs = CostModel(ROUND.with_(launch_s=1e-6, host_sync_s=1.0)).predict(small, w, only(*ONE_CHOICE))
    assert syncs.gaps[0].pass_name == "cuda-graphs"  # it also moves acceptance to the device
    fused = CostModel("h200").predict(FusedDecoder().apply(small).program, w, only(*ONE_CHOICE))
    assert "fused-decoder" not in {g.pass_name for g in fused.gaps}
    assert fused.steps.verify.kernels < CostModel("h200").predict(small, w).steps.verify.kernels
    heavy = ROUND.with_(bandwidth=1e9)  # weight bytes dominate everything
    assert CostModel(heavy).predict(small, w, only(*ONE_CHOICE)).gaps[0].pipeline == WeightsU12(min_numel=1 << 20).spec()


def test_block_size_gap_when_the_block_is_too_long(small):
    # acceptance collapses after 2 positions: a block of 8 drafts 5 tokens for nothing, and a block of
    # 2 leaves a likely second token undrafted
    acc = AcceptanceModel((0.9, 0.9, 0.0, 0.0, 0.0, 0.0, 0.0))
    e = CostModel(ROUND).predict(small, Workload(acceptance=acc), what_ifs)
    blocks = [g.pipeline for g in e.gaps if g.pass_name == "draft-block-size"]
    assert blocks == ["draft-block-size{size=3}"]
    assert e.ceiling.block_size == 3  # deeper drafts earn nothing, at the floor too


def test_the_ceiling_search_finds_the_best_of_every_block_and_candidate_set(small):
    """The beam search against brute force at the floor: u12 weights (fewer bytes: always faster at
    the floor), every block size of draft-block-size's space, every tree of tree-verify's or the chain."""
    model, w = CostModel("h200"), Workload(acceptance=AcceptanceModel.from_tau(4.0, 7))
    e = model.predict(small, w, what_ifs)
    u12 = WeightsU12(min_numel=1 << 20).apply(small).program
    assert model.predict(u12, w).t_token.floor < model.predict(small, w).t_token.floor
    best = math.inf
    for block in [u12] + [x.program for x in what_ifs(u12, ["draft-block-size"])]:
        for cand in [block] + [x.program for x in what_ifs(block, ["tree-verify"])]:
            best = min(best, model.predict(cand, w).t_token.floor)
    assert e.ceiling.t_token == pytest.approx(best, rel=1e-9)
    assert e.ceiling.t_token <= e.t_token.floor
    assert "weights-u12{min-numel=1048576" in e.ceiling.pipeline and e.ceiling.proposal.startswith("tree{")


def test_a_narrow_beam_keeps_the_fastest_and_the_seeds():
    """search_ceiling on numbers: programs stand in as labels, what-ifs step along a line."""
    @dataclasses.dataclass(frozen=True)
    class Step:
        pass_name: str
        pipeline: str
        program: object
        closes: str = ""

    times = {"p": 5.0, "a1": 4.0, "a2": 3.0, "a1b": 1.0, "a2b": 2.5, "seed": 2.0}

    def provider(program, passes=None):
        offers = {"p": [Step("a", "a{1}", "a1"), Step("a", "a{2}", "a2")], "a1": [Step("b", "b", "a1b")],
                  "a2": [Step("b", "b", "a2b")]}.get(program, [])
        return [o for o in offers if passes is None or o.pass_name in passes]

    # stage a keeps a{2} (3.0) and a{1} (4.0); b, which only they offer, is the next stage
    assert search_ceiling("p", times.get, provider, beam=CEILING_BEAM).pipeline == ("a{1}", "b")
    assert search_ceiling("p", times.get, provider, beam=1).pipeline == ("a{2}", "b")  # a{1} fell out of a beam of one
    assert search_ceiling("p", times.get, provider, seeds=[Reached(2.0, "seed", ("s",))]).program == "seed"


# -- calibration

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
H200_STEPS = RESULTS / "step_bench_h200.json"  # an IR-shaped plain torch step (cost-model calibration)
RUNTIME_STEPS = RESULTS / "step_times_h200_llama.json"  # the project runtime's forward (bench/steps/step_times.py)


def test_h200_calibrated_by_the_runtime_step_times(llama8b):
    """Calibrated by the runtime's results file, AR, verify(16) and draft(16) at 8B shapes within 15%."""
    model = CostModel("h200")
    assert model.update_from_results([RUNTIME_STEPS]) > 0
    rows = {(r["what"], r["q"]): r["ms"] * 1e-3 for r in json.loads(RUNTIME_STEPS.read_text())["records"]
            if r["shape"] == "llama-3.1-8b" and r["cache_len"] == 512 and r.get("path", "torch") == "torch"}
    for what, q in (("ar", 1), ("verify", 16), ("draft", 16)):
        predicted = model.step(llama8b, what, q, cache_len=512).time
        assert predicted == pytest.approx(rows[(what, q)], rel=0.15), (what, q)


def test_h200_predictions_within_15_percent_of_measured(llama8b):
    """Uncalibrated predictions against the measured AR, verify(16) and draft(16) steps at 8B shapes."""
    records = json.loads(H200_STEPS.read_text())["records"]
    gpu = load_gpu("h200")
    checked = set()
    for r in records:
        if r["cache_len"] != 512 or r["batch"] != 1 or not r["cuda_graphs"] or r["q"] not in (1, 16):
            continue
        graph = {"ar": llama8b.target, "verify": llama8b.target, "draft": llama8b.drafter}[r["what"]]
        predicted = step_time(graph, gpu, 1, r["q"], 512, cuda_graphs=True).time
        assert predicted == pytest.approx(r["ms"] * 1e-3, rel=0.15), r
        checked.add(r["what"])
    assert checked == {"ar", "verify", "draft"}


def test_update_scales_each_step_kind(small):
    model = CostModel(ROUND)
    w = Workload(tau=4.0)
    raw = model.predict(small, w)
    n = model.update([{"kind": "step", "what": "ar", "q": 1, "ms": raw.t_ar.value * 2e3, "gpu": "round",
                       "shape": SMALL_SHAPE},
                      {"kind": "step", "what": "verify", "q": 64, "ms": 1.0, "gpu": "h200", "shape": "x"}])
    assert n == 1  # the h200 record is for another card
    cal = model.predict(small, w)
    assert cal.calibration["ar"] == pytest.approx(2.0)
    assert cal.calibration["verify"] == pytest.approx(2.0)  # no verify record: borrows the pooled mean
    assert cal.t_ar.source == "measured" and cal.t_ar.value == pytest.approx(2 * raw.t_ar.value)
    assert cal.t_verify.source == "predicted" and cal.t_verify.value == pytest.approx(2 * raw.t_verify.value)
    assert cal.t_verify.floor == pytest.approx(raw.t_verify.floor)  # floors are never calibrated


def test_update_from_results_files(small, tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "steps.json").write_text(json.dumps({
        "gpu": "h200", "shape": SMALL_SHAPE, "commit": "abc",
        "records": [{"kind": "step", "what": "draft", "q": 8, "ms": 0.25},
                    {"kind": "acceptance", "drafter": "dflash", "histogram": [0, 0, 0, 1, 1, 1, 1, 1]},
                    {"kind": "speedup", "value": 3.0}, {"note": "provenance"}]}))
    model = CostModel("h200")
    assert model.update_from_results([results]) == 2
    e = model.predict(small, Workload(cuda_graphs=True))
    assert e.t_draft.source == "measured" and e.t_draft.value == pytest.approx(0.25e-3)
    assert e.tau.source == "measured" and e.tau.value == pytest.approx(1 + (3 + 4 + 5 + 6 + 7) / 5)
    assert explain(small, "h200", Workload(cuda_graphs=True), results=[results]).t_draft.source == "measured"


def test_kernel_rows_replace_the_u12_efficiency(small, tmp_path):
    # two rows as bench/kernels/u12_linear.py writes them: u12 as fast as cuBLAS at M=1 on 0.75x the bytes
    rows = [{"name": "o", "N": 1024, "K": 1024, "M": 1, "cublas_us": 10.0, "u12_us": 10.0,
             "u12_bytes": 750, "bf16_bytes": 1000},
            {"name": "o", "N": 1024, "K": 1024, "M": 16, "cublas_us": 10.0, "u12_us": 7.5,
             "u12_bytes": 750, "bf16_bytes": 1000}]
    (tmp_path / "u12_linear_h200.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": rows}))
    model = CostModel("h200")
    assert model.gpu.efficiency_of_kernel("triton-u12", 1) == pytest.approx(0.98)  # the database's
    assert model.update_from_results([tmp_path]) == 2
    assert model.gpu.efficiency_of_kernel("triton-u12", 1) == pytest.approx(0.75)
    assert model.gpu.efficiency_of_kernel("triton-u12", 16) == pytest.approx(1.0)
    assert model.gpu.source_of("kernel_efficiency") == "measured"


def test_kernel_rows_at_each_m_the_newest_file_wins_and_other_rows_stay(tmp_path):
    """Files read together: at each M the newest file's rows (by "date"), whatever the files' names'
    order; at M no file measures, the database's figure stays (a file used to replace the whole
    entry: the last file read, by name, then priced every M)."""
    def row(m, u12_us):  # cuBLAS 10 µs on 0.75x the bytes: efficiency 7.5 / u12_us
        return {"name": "o", "N": 1024, "K": 1024, "M": m, "cublas_us": 10.0, "u12_us": u12_us,
                "u12_bytes": 750, "bf16_bytes": 1000}
    (tmp_path / "a_new.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "date": "2026-12-06T00:00:00+00:00", "rows": [row(16, 7.5), row(16, 15.0)]}))
    (tmp_path / "b_old.json").write_text(json.dumps(
        {"gpu": "NVIDIA H200", "date": "2026-12-01T00:00:00+00:00", "rows": [row(16, 30.0), row(1, 10.0)]}))
    model = CostModel("h200")
    at64 = model.gpu.efficiency_of_kernel("triton-u12", 64)
    assert model.update_from_results([tmp_path]) == 4
    assert model.gpu.efficiency_of_kernel("triton-u12", 16) == pytest.approx((1.0 + 0.5) / 2)  # a_new's two rows
    assert model.gpu.efficiency_of_kernel("triton-u12", 1) == pytest.approx(0.75)  # only b_old measures M = 1
    assert model.gpu.efficiency_of_kernel("triton-u12", 64) == pytest.approx(at64)  # the database's


def test_each_gpu_is_calibrated_by_the_files_gpus_yaml_lists_and_no_others(llama8b):
    """The H200's list names every results file that yields its records (what globbing bench/results
    found before the list), and an explain calibrates by exactly those files."""
    gpu = load_gpu("h200")
    listed = calibration_files(gpu)
    assert listed and all(f.is_file() for f in listed)
    yielding = set()
    for f in sorted(RESULTS.glob("*.json")):
        records = parse_records(json.loads(f.read_text()), str(f))
        if any(gpu_key(r.gpu) == "h200" for r in records if hasattr(r, "gpu")):
            yielding.add(f)
    assert yielding == set(listed)
    e = explain(llama8b, "h200", Workload(tau=6.0))
    assert set(e.calibrated_by) == {f.name for f in listed}
    assert e.calibration["verify"] != 1.0  # the step files calibrate it
    assert explain(llama8b, "h200", Workload(tau=6.0), results=()).calibrated_by == ()


def test_a_stray_results_file_changes_no_prediction(small, tmp_path, monkeypatch):
    """A results file dropped into bench/results (here: the working directory's, which `specpilot
    explain` used to glob) is read by nobody until gpus.yaml lists it."""
    before = explain(small, "h200", Workload(tau=4.0)).to_dict()
    stray = tmp_path / "bench" / "results" / "step_times_h200_stray.json"
    stray.parent.mkdir(parents=True)
    stray.write_text(json.dumps({"gpu": "h200", "shape": SMALL_SHAPE, "records": [
        {"kind": "step", "what": w, "q": q, "ms": 100.0} for w, q in (("ar", 1), ("verify", 8), ("draft", 8))]}))
    monkeypatch.chdir(tmp_path)
    assert explain(small, "h200", Workload(tau=4.0)).to_dict() == before
    assert explain(small, "h200", Workload(tau=4.0), results=[stray]).t_ar.source == "measured"  # when named


def test_a_listed_file_that_moved_is_an_error_naming_it(tmp_path):
    gpu = load_gpu("h200")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    with pytest.raises(SpecError, match=r"gpus.yaml: gpus.h200.calibration names bench/results/step_bench_h200.json, "
                                        r"which is not in .*renamed or moved"):
        calibration_files(gpu, root=tmp_path)
    assert calibration_files(gpu, root=tmp_path / "installed-without-its-repository") == []


def test_bad_records_name_the_file_and_field(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"kind": "step", "what": "verify", "ms": 1.0, "gpu": "h200", "shape": "x"}]))
    with pytest.raises(SpecError, match=r"bad\.json\[0\].*'q'"):
        CostModel("h200").update_from_results([bad])


# -- the report

def test_table_and_png(small, tmp_path):
    e = CostModel("h200").predict(small, Workload(tau=4.0))
    assert isinstance(e, Estimate) and isinstance(e.t_ar, Figure)
    table = render_table(e)
    assert table.row_count >= 8
    sources = {cell for cell in table.columns[2].cells if cell}
    assert sources <= {"predicted", "measured"}
    png = plot_gaps(e, tmp_path / "gaps.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.dumps(e.to_dict())  # JSON-ready
    assert not math.isnan(e.speedup.value)


def test_fused_layers_count_the_launches_the_runtime_makes(llama8b):
    """A fused layer launches rmsnorm ×2, q|k|v, rope_qkv, attention, o, gate|up, silu_mul and down
    (runtime/fused.py): the residual adds and the k, v and up projections ride in other launches,
    unless a weight pass left q, k and v in different formats (then they run one by one)."""
    from specpilot.cost import load_gpu
    from specpilot.cost.roofline import KERNELS, step_time

    gpu = load_gpu("h200")
    fused = FusedDecoder().apply(llama8b).program
    layers = 32

    def per_layer(program, q=2):  # 2 rows: fused_linear serves 1, 5..16 and 32
        return step_time(program.target, gpu, q=q, cache_len=512).kernels

    before, after = per_layer(llama8b), per_layer(fused)
    rmsnorm, rope, mlp = KERNELS["rmsnorm"], KERNELS["rope"], KERNELS["mlp"]
    # per layer: 2 norms, 2 adds, 3 + 2 joined projections and the two activations change
    assert before - after == layers * (2 * (rmsnorm - 1) + 2 * KERNELS["add"] + 3 * KERNELS["linear"]
                                       + (rope - 1) + (mlp - 1)) + (rmsnorm - 1)  # + the final norm

    def mixed(_, node):  # q_proj alone in u12: the runtime cannot concatenate q|k|v
        return node.replace(format="u12", kernel="triton-u12") if node.get("weight", "").endswith("q_proj.weight") else None

    graph, _ = fused.target.map_nodes(mixed)
    assert step_time(graph, gpu, q=2, cache_len=512).kernels == after + 2 * layers
    # at the rows it serves (linear_serves) fused_linear takes both norms and silu_mul into the GEMMs of a layer
    # whose projections are all plain; u12_fused_linear takes silu_mul into a u12 layer's gate|up
    # and leaves its norms apart (runtime/fused.py's U12_LINEAR, U12_NORMS_APART) but hands each on
    # from the residual GEMV before it (U12_NORM_HANDOFF: all but the first layer's input norm); a
    # layer with q alone in u12 (q|k|v not joined) stays unfused
    assert per_layer(fused, q=1) == after - 3 * layers and per_layer(fused, q=2) == after
    assert per_layer(fused, q=8) == per_layer(fused, q=16) == per_layer(fused, q=32) == after - 3 * layers  # the dot kernel's rows
    assert per_layer(fused, q=17) == per_layer(fused, q=31) == per_layer(fused, q=33) == after
    assert step_time(graph, gpu, q=1, cache_len=512).kernels == after + 2 * layers
    u12 = to_u12(fused, "triton-u12")
    # at the GEMV rows and 5..16 (U12_MANY_ROWS: the hmma kernel's): silu_mul a layer, the post norms, the
    # input norms after the first layer's; 2..4 and past 16 unfused
    assert per_layer(u12, q=1) == per_layer(u12, q=8) == per_layer(u12, q=16) == per_layer(u12, q=2) - 3 * layers + 1
    assert per_layer(u12, q=2) == per_layer(u12, q=17) == per_layer(u12, q=32)
    assert per_layer(to_u12(fused, "torch"), q=1) == per_layer(u12, q=2)  # not the fused stacks' kernel


def test_fused_linear_prices_the_plain_projections_of_fused_layers_at_the_rows_it_serves(llama8b):
    """At the rows fused_linear serves, a fused layer's plain projections take its measured
    efficiency (gpus.yaml's triton-fused-linear): their memory time is the stock pricing's over
    that efficiency; other rows, unfused graphs and u12 layers keep the stock or u12 pricing."""
    from specpilot.cost import load_gpu
    from specpilot.cost.roofline import FUSED_LINEAR_KERNEL, step_time

    gpu = load_gpu("h200")
    stock = gpu.with_(kernel_efficiency={k: v for k, v in gpu.kernel_efficiency.items() if k != FUSED_LINEAR_KERNEL})
    fused = FusedDecoder().apply(llama8b).program

    def memory_times(program, g, q):
        st = step_time(program.target, g, q=q, cache_len=512, cuda_graphs=True)
        return {c.name: c.t_kernel - c.t_latency for c in st.costs if c.op == "linear"}

    for q in (1, 2, 8, 16, 17, 32, 33):
        priced, plain = memory_times(fused, gpu, q), memory_times(fused, stock, q)
        eff = gpu.efficiency_of_kernel(FUSED_LINEAR_KERNEL, q)
        assert eff > 1.0  # faster than the stock pricing at every served row (1.21 at one, 1.10 at 16)
        for name, t in priced.items():
            if q in (2, 17, 33):  # cuBLAS rows
                assert t == plain[name], (q, name)
            else:
                assert t < plain[name] and t == pytest.approx(plain[name] / eff, rel=0.02), (q, name)
    for program in (llama8b, to_u12(fused, "triton-u12")):  # not fused: stock; u12 layers: triton-u12's
        assert memory_times(program, gpu, 1) == memory_times(program, stock, 1)


def test_the_cost_model_folds_at_the_rows_the_runtime_fuses():
    """roofline's mirror of runtime/fused.py's row rule agrees with FusedOps.linear_serves, and its
    u12 switches with the runtime's."""
    from specpilot.backends.kernel_hooks import fused_ops
    from specpilot.cost import roofline
    from specpilot.runtime import fused

    ops = fused_ops("torch")
    assert (roofline.LINEAR_MAX_M, roofline.LINEAR_GEMV_MAX_M, roofline.GEMV_ROWS, roofline.LINEAR_GAP) == (
        ops.linear_max_m, ops.linear_gemv_max_m, fused.GEMV_ROWS, ops.linear_gap)
    assert (roofline.U12_LINEAR, roofline.U12_NORMS_APART, roofline.U12_NORM_HANDOFF, roofline.U12_MANY_ROWS) == (
        bool(ops.u12_kernel), ops.u12_norms_apart, ops.u12_norm_handoff, ops.u12_many_rows)
    for rows in range(1, 70):
        for u12 in (False, True):
            assert roofline.linear_serves(rows, u12) == ops.linear_serves(rows, u12), (rows, u12)
    for limit in (0, 9, 32):  # none above GEMV_ROWS, some, and all the stack's rows
        many = dataclasses.replace(ops, u12_many_rows=limit)
        with mock.patch.object(roofline, "U12_MANY_ROWS", limit):
            for rows in range(1, 70):
                for u12 in (False, True):
                    assert roofline.linear_serves(rows, u12) == many.linear_serves(rows, u12), (limit, rows, u12)


def test_a_fused_dflash_layer_keeps_its_context_kv_launch(llama8b):
    """FusedDFlash runs a k|v GEMM over the target context and a q|k|v GEMM over the block: of a
    layer's q, k and v nodes two launch (the k node, which reads the context, keeps its own)."""
    from specpilot.cost.roofline import GraphPlan, folded_launches

    fused = FusedDecoder().apply(llama8b).program
    nodes = {n: (node, inputs) for n, node, inputs in GraphPlan.of(fused.drafter, fused.target).entries}
    folded = folded_launches(nodes)
    assert "layers.0.v_proj" in folded and "layers.0.up_proj" in folded
    assert "layers.0.k_proj" not in folded and "layers.0.q_proj" not in folded
