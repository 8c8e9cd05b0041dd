"""The fused decoder kernels against the runtime's own modules (model.py), and under a CUDA graph.

The kernels against their references on odd shapes are tests/test_kernels.py's (the registry);
here the references' claim to be model.py op for op is checked on a tiny qwen3 / llama layer in
bf16, bit for bit, and so are the kernels (the interpreter's reductions round as torch's CPU ones
do here; on a GPU the qk-norm and RMSNorm rows may differ by one bf16 step, see the kernels).
"""

import dataclasses

import pytest
import torch

from conftest import DEVICE
from specpilot.hf.config import ModelConfig
from specpilot.kernels.overlap import Launch, pdl_mode, prefetch_args
from specpilot.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from specpilot.kernels.rope_kv import rope_qkv, rope_qkv_reference
from specpilot.kernels.silu_mul import silu_mul, silu_mul_reference
from specpilot.runtime.model import MLP, Attention, RMSNorm, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.interpreter
BF16 = torch.bfloat16


def _cfg(family: str) -> ModelConfig:
    return ModelConfig(family=family, vocab_size=16, hidden_size=96, intermediate_size=80, num_layers=1,
                       num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, qk_norm=family == "qwen3", max_position_embeddings=4096,
                       bos_token_id=None, eos_token_id=None)


def _randomise(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else 0.1 * torch.randn(p.shape, generator=g))
    return module.to(DEVICE, BF16)


def _exact(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"{(a != b).sum().item()} of {a.numel()} differ, worst {(a.float() - b.float()).abs().max().item()}"


def test_rmsnorm_equals_the_model_norm_and_the_residual_add():
    norm = _randomise(RMSNorm(96, 1e-6), 0)
    g = torch.Generator().manual_seed(1)
    x, attn_out = ((4 * torch.randn(2, 5, 96, generator=g)).to(DEVICE, BF16) for _ in range(2))
    with torch.no_grad():
        _exact(rmsnorm_reference(x, norm.weight, norm.eps), norm(x))
        _exact(rmsnorm(x, norm.weight, norm.eps), norm(x))
        y, h = rmsnorm(attn_out, norm.weight, norm.eps, residual=x)
        _exact(h, x + attn_out)
        _exact(y, norm(x + attn_out))


def test_silu_mul_equals_the_model_mlp_middle():
    mlp = _randomise(MLP(_cfg("llama")), 2)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(3)).to(DEVICE, BF16)
    with torch.no_grad():
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], -1)
        want = torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)
        _exact(silu_mul_reference(gate_up), want)
        _exact(silu_mul(gate_up), want)
        _exact(mlp.down_proj(silu_mul(gate_up)), mlp(x))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("queries", [True, False], ids=["qkv", "kv-only"])
def test_rope_qkv_equals_the_model_projections_and_cache_write(family, tree, queries):
    """A chain writes at past + t with positions past + t; a tree at past + node with positions
    past + depth. q and the cache equal Attention.queries / keys_values and KVCache.write's.
    Without queries (a DFlash drafter's context: num_heads=0, [k|v] in) q is empty."""
    cfg = _cfg(family)
    attn = _randomise(Attention(cfg), 4)
    b, t, past, cap = 2, 4, 37, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(b, t, cfg.hidden_size, generator=g).to(DEVICE, BF16)
    depth = torch.tensor([0, 1, 1, 2]) if tree else torch.arange(t)
    positions = (past + depth).expand(b, t).to(DEVICE)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg, DEVICE), positions, BF16)
    slots = (past + torch.arange(t)).expand(b, t).to(DEVICE, torch.int32)
    k_cache, v_cache = (torch.randn(b, cfg.num_kv_heads, cap, cfg.head_dim, generator=g).to(DEVICE, BF16) for _ in range(2))
    with torch.no_grad():
        qkv = torch.cat([attn.q_proj(x)] * queries + [attn.k_proj(x), attn.v_proj(x)], -1)
        want_q = attn.queries(x, cos, sin) if queries else torch.empty(b, 0, t, cfg.head_dim, dtype=BF16, device=DEVICE)
        k, v = attn.keys_values(x, cos, sin)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[:, :, past:past + t], want_v[:, :, past:past + t] = k, v
    norms = dict(k_norm_weight=attn.k_norm.weight.detach(), eps=attn.k_norm.eps) if cfg.qk_norm else {}
    if cfg.qk_norm and queries:
        norms["q_norm_weight"] = attn.q_norm.weight.detach()
    for fn in (rope_qkv_reference, rope_qkv):
        kc, vc = k_cache.clone(), v_cache.clone()
        q = fn(qkv, cos, sin, kc, vc, slots, num_heads=cfg.num_heads * queries, num_kv_heads=cfg.num_kv_heads, **norms)
        _exact(q, want_q)
        _exact(kc, want_k)
        _exact(vc, want_v)
        assert q.is_contiguous()


@pytest.mark.gpu
def test_fused_kernels_replay_in_one_cuda_graph():
    """One captured step: slots and cos/sin change in place between replays, nothing else."""
    g = torch.Generator().manual_seed(6)
    h, hkv, d, cap = 32, 8, 128, 256
    qkv = torch.randn(1, 1, (h + 2 * hkv) * d, generator=g).to(DEVICE, BF16)
    x, res = (torch.randn(1, 1, 4096, generator=g).to(DEVICE, BF16) for _ in range(2))
    w = torch.ones(4096, device=DEVICE, dtype=BF16)
    gate_up = torch.randn(1, 1, 2 * 14336, generator=g).to(DEVICE, BF16)
    k_cache, v_cache = (torch.zeros(1, hkv, cap, d, device=DEVICE, dtype=BF16) for _ in range(2))
    slots = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEVICE).float() / d))
    cos, sin = rope_cos_sin(inv_freq, slots.long(), BF16)

    def step():
        q = rope_qkv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=h, num_kv_heads=hkv)
        return q, rmsnorm(x, w, 1e-5, residual=res), silu_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, (y, hsum), act = step()
    for p in (3, 200):
        slots.fill_(p)
        c, s = rope_cos_sin(inv_freq, slots.long(), BF16)
        cos.copy_(c)
        sin.copy_(s)
        graph.replay()
        kc, vc = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        want_q = rope_qkv_reference(qkv, cos, sin, kc, vc, slots, num_heads=h, num_kv_heads=hkv)
        _exact(q, want_q)
        _exact(k_cache[:, :, p], kc[:, :, p])
        _exact(v_cache[:, :, p], vc[:, :, p])
    want_y, want_h = rmsnorm_reference(x, w, 1e-5, residual=res)
    _exact(hsum, want_h)
    torch.testing.assert_close(y, want_y, atol=0, rtol=2 ** -6)
    torch.testing.assert_close(act, silu_mul_reference(gate_up), atol=0, rtol=2 ** -7)


def test_launch_settings_are_checked_and_off_without_a_gpu():
    """Launch takes PDL modes 0-2 and a bool prefetch, else a ValueError naming the field; where the
    device has no PDL (a CPU, the interpreter, a GPU before sm_90) both are off."""
    for bad, field in ((dict(pdl=3), "Launch.pdl"), (dict(pdl=True), "Launch.pdl"), (dict(prefetch=1), "Launch.prefetch")):
        with pytest.raises(ValueError, match=field):
            Launch(**bad)
    cpu = torch.device("cpu")
    assert pdl_mode(cpu, Launch(pdl=2)) == 0 and pdl_mode(cpu, None) == 0
    assert prefetch_args(cpu, torch.zeros(64), Launch(prefetch=True)) == (0, 0, 0, 0, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("q", [1, 16])
def test_launch_settings_change_no_value(q):
    """Programmatic dependent launch (both modes) and the L2 prefetch of o_proj (kernels/overlap.py)
    move no value: a fused AR step (fused_linear at one row), and a verify step of 16 (its dot kernel),
    replayed from a CUDA graph gives the logits of the same step captured with plain launches, bit for
    bit, eagerly too. The prefetch rides in rope_qkv, so with it the step runs RoPE apart from
    attention: its plain twin does too."""
    from specpilot.backends.kernel_hooks import fused_path, with_launch
    from specpilot.runtime.model import Transformer

    cfg = dataclasses.replace(_cfg("qwen3"), num_layers=3, vocab_size=300)
    torch.manual_seed(0)
    model = _randomise(Transformer(cfg), 9)
    ids = torch.arange(7, 7 + q, device=DEVICE)[None]
    o_weight = model.model.layers[0].self_attn.o_proj.weight
    capable = torch.cuda.get_device_capability() >= (9, 0)
    logits = {}
    with fused_path(model), torch.no_grad():
        cache = model.new_cache(1, 64, device_length=True)
        start = torch.tensor(5, device=DEVICE)
        ops = model.fused.ops

        def step():
            cache.length.copy_(start)
            return model(ids, cache).logits

        for label, launch, apart in (("pdl", Launch(pdl=1), False), ("wait", Launch(pdl=2), False),
                                     ("plain", Launch(), False), ("pdl-prefetch", Launch(pdl=1, prefetch=True), True),
                                     ("plain-apart", Launch(), True)):
            model.fused.ops = with_launch(dataclasses.replace(ops, rope_attention=None) if apart else ops, launch)
            assert (pdl_mode(DEVICE, launch), prefetch_args(DEVICE, o_weight, launch)[0]) == (
                launch.pdl * capable, int(launch.prefetch and capable))
            eager = step().clone()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            graph.replay()
            torch.cuda.synchronize()
            logits[label] = (eager, out.clone())
        model.fused.ops = ops
    for label, twin in (("pdl", "plain"), ("wait", "plain"), ("pdl-prefetch", "plain-apart")):
        for a, b in zip(logits[label], logits[twin]):
            _exact(a, b)


@pytest.mark.parametrize("family,mask,past_kind", [  # each pair of the three choices once
    ("llama", "causal", "int"), ("llama", "tree", "tensor"), ("qwen3", "causal", "tensor"), ("qwen3", "tree", "int")])
def test_rope_attention_equals_rope_qkv_then_attention(family, mask, past_kind):
    """One launch (kernels/rope_attention.py) gives what rope_qkv then attention_split_kv give on the
    same splits, bit for bit: the cache (roped k, raw v at past..past+T-1, nothing else written)
    and the attention output; qwen3's qk-norm too, except on a GPU (its reductions' order)."""
    from specpilot.kernels.attention_split_kv import attention_split_kv
    from specpilot.kernels.rope_attention import rope_attention

    cfg = _cfg(family)
    attn = _randomise(Attention(cfg), 7)
    b, t, past, cap = 2, 5, 70, 96
    g = torch.Generator().manual_seed(8)
    qkv = torch.randn(b, t, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, generator=g).to(DEVICE, BF16)
    depth = torch.tensor([0, 1, 1, 2, 3]) if mask == "tree" else torch.arange(t)
    vis = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]],
                       dtype=torch.bool, device=DEVICE) if mask == "tree" else "causal"
    cos, sin = rope_cos_sin(rope_inv_freq(cfg, DEVICE), (past + depth).expand(b, t).to(DEVICE), BF16)
    k_cache, v_cache = (torch.randn(b, cfg.num_kv_heads, cap, cfg.head_dim, generator=g).to(DEVICE, BF16) for _ in range(2))
    norms = dict(q_norm_weight=attn.q_norm.weight.detach(), k_norm_weight=attn.k_norm.weight.detach()) if cfg.qk_norm else {}
    heads = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    slots = (past + torch.arange(t)).expand(b, t).to(DEVICE)
    p = torch.tensor(past, device=DEVICE) if past_kind == "tensor" else past
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q = rope_qkv(qkv, cos, sin, want_k, want_v, slots, **heads, **norms)
    keys = cap if past_kind == "tensor" else past + t
    want = attention_split_kv(q, want_k[:, :, :keys], want_v[:, :, :keys], past=p, mask=vis, splits=2)
    kc, vc = k_cache.clone(), v_cache.clone()
    out = rope_attention(qkv, cos, sin, kc, vc, past=p, mask=vis, splits=2, **heads, **norms)
    if cfg.qk_norm and DEVICE.type == "cuda":  # the Σx² of a head reduced in another order: a step of bf16
        for a, w in ((kc, want_k), (vc, want_v), (out, want)):
            torch.testing.assert_close(a, w, atol=2 ** -5, rtol=2 ** -6)
        return
    _exact(kc, want_k)
    _exact(vc, want_v)
    _exact(out, want)
