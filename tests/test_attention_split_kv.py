"""The split-KV attention kernel in the compiler: the pass, the runtime seam, the backend, a compile.

The kernel against its reference on odd shapes is tests/test_kernels.py's (the registry). Without
CUDA the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py).
"""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specpilot.backends.torch_backend import install_attention_kernels
from specpilot.dsl import parse_pipeline
from specpilot.errors import EngineError
from specpilot.ir import lower, verify_program
from specpilot.kernels.attention_split_kv import (
    BLOCK_N, attention_split_kv, attention_split_kv_reference, plan, sm_count, split_count)
from specpilot.passes import all_lossless, run_passes
from specpilot.passes.attention_split_kv import AttentionSplitKV
from specpilot.runtime import decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import attend, attend_visible, build_mask

from conftest import DEVICE
from test_ir import DFLASH, PARD, TARGET


# --- the pass ---------------------------------------------------------------------------------

@pytest.mark.parametrize("drafter", [DFLASH, PARD], ids=["dflash", "pard"])
def test_pass_sets_the_kernel_of_every_attention_node_and_nothing_else(drafter):
    p = lower(TARGET, drafter)
    q, [rec] = run_passes(p, parse_pipeline("attention-split-kv"))
    assert rec.changed and rec.lossless and all_lossless([rec])
    verify_program(q)
    assert rec.summary == f"{len(p.target.find('attention')) + len(p.drafter.find('attention'))} attention nodes on triton-split-kv"
    for level in ("target", "drafter"):
        before, after = p.graph(level), q.graph(level)
        for name, node in before.items():
            if node.op == "attention":
                assert after.node(name) == node.replace(kernel="triton-split-kv"), name
            else:
                assert after.node(name) == node, name
    assert q.step == p.step
    assert AttentionSplitKV.schedule_space(p) == [AttentionSplitKV()]
    assert AttentionSplitKV.schedule_space(q) == []
    again, [rec2] = run_passes(q, [AttentionSplitKV()])
    assert not rec2.changed and again == q


# --- the kernel's API -------------------------------------------------------------------------

@pytest.mark.parametrize("mask", ["causal", "full", "tree"])
def test_reference_equals_the_runtime_attend(mask):
    """The kernel's reference and the runtime's `attend` (SDPA under build_mask) agree in fp32."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g), torch.randn(2, 2, 12, 32, generator=g)
    if mask == "tree":
        mask = torch.eye(5, dtype=torch.bool)
        mask[1:, 0] = True
        mask[3, 1] = mask[4, 3] = mask[4, 1] = True
    ref = attention_split_kv_reference(q, k, v, past=7, mask=mask)
    torch.testing.assert_close(ref, attend(q, k, v, build_mask(mask, 7, 5, q.device)), atol=1e-6, rtol=1e-5)


def test_split_rule():
    # Llama-3.1-8B on an H200 (132 SMs), batch 1, 8 kv heads of group 4
    assert split_count(32768, rows=4, programs=8, sms=132) == 33  # 2 programs a SM
    assert split_count(512, rows=4, programs=8, sms=132) == 8  # one tile each
    assert split_count(512, rows=256, programs=32, sms=132) == 1  # partials would outweigh the cache
    assert split_count(32768, rows=256, programs=32, sms=132) == 9
    assert split_count(2048, rows=68, programs=16, sms=132) == 15  # a 17-node tree in a 2048-slot cache
    assert split_count(1, rows=1, programs=1, sms=132) == 1
    for s in (1, 7, 300, 5000):
        for rows in (1, 4, 64, 256):
            n = split_count(s, rows, programs=4, sms=132)
            assert 1 <= n <= -(-s // BLOCK_N) and (n == 1 or n <= s // (2 * rows))
    # whole tiles a split, and the rule leaves no split empty (33 splits of 993 keys become 32 of 1024)
    assert plan(1, 32, 8, 1, 32768, sms=132) == (16, 1, 32, 1024)
    assert plan(1, 32, 8, 64, 300, sms=132) == (64, 4, 1, 320)
    for s in (1, 7, 300, 5000, 32768):
        p = plan(2, 8, 2, 3, s, sms=132)
        assert p.split_len % BLOCK_N == 0 and (p.splits - 1) * p.split_len < s <= p.splits * p.split_len
    assert plan(1, 4, 2, 3, 7, sms=132, splits=3).splits == 3  # as asked, even where splits hold no key


def test_arguments_are_checked():
    q, k = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="past \\+ T"):
        attention_split_kv(q, k, k, past=4, mask="causal")
    with pytest.raises(ValueError, match="mask must be"):
        attention_split_kv(q, k, k, past=5, mask="tree")
    with pytest.raises(ValueError, match="\\[T, T\\] or \\[B, T, T\\]"):
        attention_split_kv(q, k, k, past=5, mask=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attention_split_kv(torch.zeros(1, 3, 3, 16), k, k, past=5)
    with pytest.raises(ValueError, match="\\[\\], \\[1\\] or \\[B=1\\]"):
        attention_split_kv(q, k, k, past=torch.tensor([5, 5]))
    with pytest.raises(ValueError, match="int32/int64"):
        attention_split_kv(q, k, k, past=torch.tensor(5.0))
    with pytest.raises(ValueError, match="cannot hold T=3"):
        attention_split_kv(q, k[:, :, :2], k[:, :, :2], past=torch.tensor(0))


@pytest.mark.interpreter
@pytest.mark.parametrize("mask", ["causal", "full", "tree"])
def test_past_tensor_equals_past_int(mask):
    """Over a cache of capacity 150 whose slots from past + T on hold NaN, a device past gives the
    int path's output on the first past + T slots, bit for bit, with one split and with the rule's
    splits for the capacity and with 20: each program cuts the keys cached now into its splits as
    the int path cuts them given that many splits (the same tiles in the same order)."""
    g = torch.Generator().manual_seed(1)
    b, t, cap = 2, 3, 150
    q = torch.randn(b, 4, t, 64, generator=g).to(DEVICE)
    k, v = (torch.randn(b, 2, cap, 64, generator=g).to(DEVICE) for _ in range(2))
    pasts = [70, 9]
    for i, p in enumerate(pasts):
        k[i, :, p + t:] = v[i, :, p + t:] = float("nan")
    if mask == "tree":
        mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool, device=DEVICE)
    past = torch.tensor(pasts, dtype=torch.int32, device=DEVICE)
    rule = plan(b, 4, 2, t, cap - t, sm_count(DEVICE)).splits
    assert rule > 1
    for splits in (1, None, 20):  # 20: past COMBINE_CHUNK, the combine reads the filled splits only
        out = attention_split_kv(q, k, v, past=past, mask=mask, splits=splits)
        for i, p in enumerate(pasts):
            row = attention_split_kv(q[i:i + 1], k[i:i + 1, :, :p + t], v[i:i + 1, :, :p + t], past=p, mask=mask,
                                     splits=splits or rule)
            assert torch.equal(out[i:i + 1], row)


@pytest.mark.interpreter
def test_past_tensor_moves_without_a_new_plan():
    """What a CUDA graph replays: the same buffers, past changed in place; every step matches the
    reference, and the grid (plan) depends on the capacity only."""
    g = torch.Generator().manual_seed(2)
    cap, t = 200, 1
    q = torch.randn(1, 4, t, 64, generator=g).to(DEVICE)
    k, v = (torch.randn(1, 1, cap, 64, generator=g).to(DEVICE) for _ in range(2))
    past = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for p in (0, 63, 64, 130, cap - t):
        past.fill_(p)
        out = attention_split_kv(q, k, v, past=past)
        ref = attention_split_kv_reference(q, k[:, :, :p + t], v[:, :, :p + t], past=p)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_one_cuda_graph_serves_every_past():
    g = torch.Generator().manual_seed(3)
    cap, t = 4096, 4
    q = torch.randn(1, 32, t, 128, generator=g).to(DEVICE, torch.bfloat16)
    k, v = (torch.randn(1, 8, cap, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
    past = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    attention_split_kv(q, k, v, past=past)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_split_kv(q, k, v, past=past)
    for p in (0, 100, 1000, cap - t):
        past.fill_(p)
        graph.replay()
        ref = attention_split_kv_reference(q, k[:, :, :p + t], v[:, :, :p + t], past=p)
        torch.testing.assert_close(out, ref, atol=4e-3, rtol=8e-3)


# --- the runtime seam and the backend ---------------------------------------------------------

@pytest.fixture
def tiny_llama(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    dirs = {part: resolve_builtin(f"tiny-llama{part}") for part in ("", "/dflash")}
    configs = [json.loads((d / "config.json").read_text()) for d in dirs.values()]
    return dirs[""], dirs["/dflash"], lower(*configs, dtype="float32")


@pytest.mark.interpreter
def test_kernel_installed_in_the_runtime_gives_the_default_tokens(tiny_llama):
    target_dir, dflash_dir, program = tiny_llama
    target, cfg = load_target(target_dir, dtype=torch.float32, device=DEVICE)
    drafter = load_drafter(dflash_dir, target, cfg, dtype=torch.float32, device=DEVICE)
    prompt = list(range(60, 71))
    kw = dict(max_new_tokens=8, eos_token_id=None)
    ar = decode.generate_ar(target, prompt, **kw)
    sp = decode.generate_dflash(target, drafter, prompt, block_size=4, mask_token_id=drafter.mask_token_id, **kw)
    # one verify-sized forward after the prompt under each kind of mask
    cache = target.new_cache(1, 32)
    target(torch.tensor([prompt], device=DEVICE), cache)
    ids = torch.tensor([[5, 6, 7, 8]], device=DEVICE)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool, device=DEVICE)
    masks = ("causal", "full", tree)

    def step_logits():
        out = []
        for mask in masks:
            cache.rollback(len(prompt))
            out.append(target(ids, cache, mask=mask).logits)
        return out

    before = step_logits()

    program, _ = run_passes(program, [AttentionSplitKV()])
    n = install_attention_kernels(program.target, target, DEVICE) + install_attention_kernels(program.drafter, drafter, DEVICE)
    assert n == cfg.num_layers + len(drafter.layers)
    assert all(layer.self_attn.attention is not attend_visible for layer in [*target.model.layers, *drafter.layers])

    for after, ref in zip(step_logits(), before):  # fp32 sums in another order: the kernel's splits, torch's threads
        torch.testing.assert_close(after, ref, atol=1e-4, rtol=1e-4)
    assert decode.generate_ar(target, prompt, **kw).tokens == ar.tokens
    assert decode.generate_dflash(target, drafter, prompt, block_size=4, mask_token_id=drafter.mask_token_id,
                                  **kw).tokens == sp.tokens


def test_backend_refuses_the_kernel_where_it_cannot_run(tiny_llama, monkeypatch):
    target_dir, _, program = tiny_llama
    target, _ = load_target(target_dir, dtype=torch.float32, device="cpu")
    assert install_attention_kernels(program.target, target, torch.device("cpu")) == 0  # sdpa: nothing to do
    program, _ = run_passes(program, [AttentionSplitKV()])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(EngineError, match="triton-split-kv.*CUDA"):
        install_attention_kernels(program.target, target, torch.device("cpu"))


@pytest.mark.interpreter
def test_compile_with_the_pass_passes_token_forcing(tmp_path, monkeypatch):
    from specpilot.compiler import compile_pipeline
    from specpilot.spec import parse_spec

    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    spec = parse_spec({"name": "t", "target": "tiny-llama", "drafter": {"kind": "dflash", "block_size": 4},
                       "gpu": "h200", "serving": {"max_new_tokens": 4},
                       "benchmark": {"prompts": "code-smoke", "num_prompts": 1}}, "test")
    result = compile_pipeline(spec, out_dir=None, passes="attention-split-kv", device=str(DEVICE))
    assert result.pipeline == "attention-split-kv"
    assert result.validation.passed and result.validation.tokens_checked == 4
    assert result.measurement.spec_tokens == result.measurement.ar_tokens
    layer = result.program.target.node("layers.0.attention")
    assert layer["kernel"] == "triton-split-kv"


# --- rope_attention: RoPE, the cache write and attention in one launch --------------------------

@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)  # beside the registry's six rope_attention cases (tests/test_kernels.py)
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 3), t=st.integers(1, 20),
       past=st.integers(0, 90), half=st.sampled_from([8, 9, 16]), mask=st.sampled_from(["causal", "full", "tree"]),
       qk_norm=st.booleans(), as_tensor=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_attention_equals_its_reference(b, hkv, group, t, past, half, mask, qk_norm, as_tensor, seed):
    """Any small shape, mask, qk-norm and kind of past: the output and the written caches as
    rope_qkv's reference then attention's (fp32), slots past past + T untouched."""
    from specpilot.kernels.rope_attention import rope_attention, rope_attention_reference
    from specpilot.runtime.model import rope_cos_sin

    g = torch.Generator().manual_seed(seed)
    d, h, cap = 2 * half, hkv * group, past + t + 5
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=g).to(DEVICE)
    caches = [torch.randn(b, hkv, cap, d, generator=g).to(DEVICE) for _ in range(2)]
    if mask == "tree":
        mask = torch.eye(t, dtype=torch.bool)
        for u in range(1, t):
            mask[u] |= mask[int(torch.randint(0, u, (1,), generator=g))]
        mask = mask.to(DEVICE)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = (x.to(DEVICE) for x in rope_cos_sin(inv_freq, (past + torch.arange(t)).expand(b, t), torch.float32))
    norms = dict(q_norm_weight=(1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE),
                 k_norm_weight=(1 + 0.2 * torch.randn(d, generator=g)).to(DEVICE)) if qk_norm else {}
    p = torch.tensor(past, device=DEVICE) if as_tensor else past
    outs = []
    for fn in (rope_attention, rope_attention_reference):
        k, v = (c.clone() for c in caches)
        outs.append((fn(qkv, cos, sin, k, v, past=p, num_heads=h, num_kv_heads=hkv, mask=mask, **norms), k, v))
    (out, k, v), (want, want_k, want_v) = outs
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, want_v, atol=0, rtol=0)
    assert torch.equal(k[:, :, past + t:], caches[0][:, :, past + t:]) and torch.equal(k[:, :, :past], caches[0][:, :, :past])


def test_rope_attention_arguments_are_checked():
    from specpilot.kernels.rope_attention import rope_attention

    qkv, cache = torch.zeros(1, 3, (4 + 2 * 2) * 16), torch.zeros(1, 2, 10, 16)
    cos = torch.zeros(1, 3, 16)
    ok = dict(num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="rope_attention: past \\+ T = 8 \\+ 3 must fit the cache's S=10 slots"):
        rope_attention(qkv, cos, cos, cache, cache, past=8, **ok)
    with pytest.raises(ValueError, match="rope_attention: num_heads must be >= 1"):
        rope_attention(qkv[..., 64:], cos, cos, cache, cache, past=0, num_heads=0, num_kv_heads=2)
    with pytest.raises(ValueError, match="rope_attention: cos must be"):
        rope_attention(qkv, cos[:, :2], cos, cache, cache, past=0, **ok)
    with pytest.raises(ValueError, match="rope_attention: k_cache must be \\[1, 2, S, 16\\]"):
        rope_attention(qkv, cos, cos, cache[:, :1], cache, past=0, **ok)
    with pytest.raises(ValueError, match="rope_attention: num_heads=3 must be a multiple of num_kv_heads=2"):
        rope_attention(torch.zeros(1, 3, (3 + 4) * 16), cos, cos, cache, cache, past=0, num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="a past tensor must be int32/int64"):
        rope_attention(qkv, cos, cos, cache, cache, past=torch.tensor(1.0), **ok)
