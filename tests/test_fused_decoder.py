"""The fused stacks (runtime/fused.py) against the models' own forwards: the target's decoder and
the DFlash drafter's add_context and forward.

With the kernels' torch references, the only numerical change is the concatenated q|k|v (k|v) and
gate|up GEMMs (a BLAS may block a wider matrix differently: fp32 GEMVs moved by ~1e-6 on CPU).
So: bit-exact with the concatenation undone, close with it, and the same greedy tokens. Under the
Triton interpreter the kernels themselves run, also inside a graphed decode loop.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specpilot.runtime import decode
from specpilot.runtime import graph_decode as gd
from specpilot.backends.kernel_hooks import fused_path, install
from specpilot.runtime.fused import FusedDecoder, FusedDFlash
from specpilot.runtime.load import load_drafter, load_target

from conftest import FAMILIES

pytestmark = pytest.mark.usefixtures("torch_single_thread")
# The "triton" ops here run on the CPU models under the interpreter (conftest.py sets it where there
# is no CUDA); with a GPU they would get CPU tensors. The kernels' GPU coverage: tests/test_kernels.py,
# test_fused_kernels.py, test_fused_linear.py and test_graph_decode.py (bench/run_gpu.sh tests).
# Triton kernels over the tiny models' CPU tensors: the interpreter only (a GPU run skips them).
INTERPRETER_ONLY = (pytest.mark.interpreter,
                    pytest.mark.skipif(torch.cuda.is_available(), reason="Triton kernels on CPU tensors: interpreter only"))


def interpreter_only(test):
    for mark in INTERPRETER_ONLY:
        test = mark(test)
    return test


def _pair(dirs, dtype):
    """(reference, model to fuse, config). The reference's projections are re-pointed at
    concatenated weights too (then served unfused): a CPU BLAS can round a GEMV over a slice of
    a larger matrix differently from one over its own copy, which is not what is tested here."""
    ref, cfg = load_target(dirs["target"], dtype=dtype, device="cpu")
    install(ref, "torch")
    ref.fused = None
    fused, _ = load_target(dirs["target"], dtype=dtype, device="cpu")
    return ref, fused, cfg


TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """TOLERANCE[dtype], and in bf16 also two ulps of the tensor's largest entry: a hidden state is
    a residual stream minus large parts, so one rounding of a ~90 entry (0.5 in bf16, seen where a
    CPU's AMX GEMM blocks the concatenated matrix differently) lands on entries near 1. A wiring
    error moves entries by the tensor's own scale, far beyond this."""
    tol = dict(TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        tol["atol"] = max(tol["atol"], 2.0**-6 * expected.float().abs().max().item())
    torch.testing.assert_close(actual, expected, **tol)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device_length", [False, True])
@pytest.mark.parametrize("concat", [False, True])
def test_fused_references_match_the_forward(family, dtype, device_length, concat, tiny_model_dirs):
    ref, fused, cfg = _pair(tiny_model_dirs[family], dtype)
    decoder = install(fused, "torch")
    if not concat:  # project one by one: what is left is the wiring, which must be exact
        for layer in decoder.layers:
            layer.qkv = layer.gate_up = None
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, 13), generator=g)
    layers = (0, cfg.num_layers - 1)
    c_ref = ref.new_cache(1, 40, device_length=device_length)
    c_fused = fused.new_cache(1, 40, device_length=device_length)
    for chunk, mask in ((ids, "causal"), (ids[:, :1], "causal"), (ids[:, :5], "full")):
        a = ref(chunk, c_ref, mask=mask, hidden_layers=layers)
        b = fused(chunk, c_fused, mask=mask, hidden_layers=layers)
        check = torch.equal if not concat else lambda x, y: assert_close(x, y, dtype) is None
        assert check(a.logits, b.logits)
        assert check(a.hidden, b.hidden)
    for i in range(cfg.num_layers):  # the same K/V landed in the same slots
        assert check(c_ref.k[i], c_fused.k[i]) and check(c_ref.v[i], c_fused.v[i])


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_greedy_tokens_equal_ar(family, tiny_model_dirs):
    ref, fused, _ = _pair(tiny_model_dirs[family], torch.float32)
    install(fused, "torch")
    prompt = [7, 3, 9, 1, 4]
    assert (decode.generate_ar(fused, prompt, max_new_tokens=24, eos_token_id=None).tokens
            == decode.generate_ar(ref, prompt, max_new_tokens=24, eos_token_id=None).tokens)


def test_fused_projections_share_storage(tiny_model_dirs):
    _, fused, _ = _pair(tiny_model_dirs["qwen3"], torch.float32)
    decoder = install(fused, "torch")
    layer = decoder.layers[0]
    attn, mlp = layer.layer.self_attn, layer.layer.mlp
    storage = lambda m: m.weight.untyped_storage().data_ptr()  # noqa: E731
    assert storage(attn.q_proj) == storage(attn.k_proj) == storage(attn.v_proj)
    assert storage(mlp.gate_proj) == storage(mlp.up_proj)
    h = torch.randn(2, attn.q_proj.in_features, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer.project_qkv(h), torch.cat([attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)], -1))
    torch.testing.assert_close(layer.project_gate_up(h), torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], -1))


@interpreter_only
def test_fused_triton_kernels_in_a_graphed_dflash_loop(tiny_model_dirs):
    """The graphed DFlash loop on the Triton stack (rope_qkv, then the model's attention) gives the
    AR tokens. Llama's: qwen3's runs under fused_path in test_rope_attention_serves_split_kv_layers,
    on the same stack with its fused drafter (rope_qkv with qk-norm for the drafter's context)."""
    dirs = tiny_model_dirs["llama"]
    ref, fused, cfg = _pair(dirs, torch.float32)
    install(fused, "triton")
    drafter = load_drafter(dirs["dflash"], fused, cfg, dtype=torch.float32, device="cpu")
    prompt = [5, 9, 2, 6, 5, 3]
    ar = decode.generate_ar(ref, prompt, max_new_tokens=4, eos_token_id=None)
    out = gd.generate_dflash_graphed(fused, drafter, prompt, block_size=drafter.block_size,
                                     mask_token_id=drafter.mask_token_id, max_new_tokens=4, eos_token_id=None)
    assert out.tokens == ar.tokens


# --- the DFlash drafter ----------------------------------------------------------------------

def _drafters(dirs):
    """(target, reference, fused) with two DFlash drafters on the (unfused) target; the reference
    re-pointed at concatenated weights too, as in _pair."""
    target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
    ref = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu")
    install(ref, "torch")
    ref.fused = None
    fused = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu")
    return target, ref, fused


def _unconcat(stack):
    """Project one by one: what is left is the wiring."""
    for layer in stack.layers:
        layer.qkv = layer.kv = layer.gate_up = None


def _draft_steps(drafter, device_length, seed=11):
    """Logits of a few draft steps, the cache's length after each, and the cache: new context of 7,
    then 3 (of which 2 kept, with `count`, on a device-length cache), then none, then context alone.
    The cache starts random, so that a write to a wrong slot (or a missing one) shows."""
    g = torch.Generator().manual_seed(seed)
    width = len(drafter.target_layer_ids) * drafter.cfg.model.hidden_size
    cache = drafter.new_cache(1, 32, device_length=device_length)
    for layer in (*cache.k, *cache.v):
        layer.copy_(torch.randn(layer.shape, generator=g))
    block = torch.tensor([[5] + [drafter.mask_token_id] * (drafter.block_size - 1)])
    logits, lengths = [], []
    with torch.inference_mode():
        for n, count in ((7, None), (3, torch.tensor(2) if device_length else None), (0, None)):
            logits.append(drafter(block, torch.randn(1, n, width, generator=g), cache, count))
            lengths.append(int(cache.length))
        drafter.add_context(torch.randn(1, 2, width, generator=g), cache)
        lengths.append(int(cache.length))
    return logits, lengths, cache


def _count_heads(stack) -> list[int]:
    """The q heads of every rope_qkv call `stack` makes from now on (that the fused path ran)."""
    heads: list[int] = []
    rope_qkv = stack.ops.rope_qkv

    def counted(*args, num_heads, **kw):
        heads.append(num_heads)
        return rope_qkv(*args, num_heads=num_heads, **kw)

    stack.ops = dataclasses.replace(stack.ops, rope_qkv=counted)
    return heads


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("device_length", [False, True])
@pytest.mark.parametrize("ops,concat", [("torch", False), ("torch", True),
                                        pytest.param("triton", True, marks=INTERPRETER_ONLY)])
def test_fused_dflash_matches_the_drafter(family, device_length, ops, concat, tiny_model_dirs):
    """Logits, cache lengths and every cache slot (the block's scratch too) as DFlashDrafter's own."""
    _, ref, fused = _drafters(tiny_model_dirs[family])
    stack = install(fused, ops)
    if not concat:
        _unconcat(stack)
    heads = _count_heads(stack)
    want, want_lengths, want_cache = _draft_steps(ref, device_length)
    got, got_lengths, got_cache = _draft_steps(fused, device_length)
    layers = len(stack.layers)  # 3 context writes with no q heads, 3 blocks with all of them
    assert sorted(heads) == [0] * 3 * layers + [stack.heads] * 3 * layers
    if ops == "torch" and not concat:
        check = torch.equal
    else:
        check = lambda x, y: torch.testing.assert_close(x, y, **TOLERANCE[torch.float32]) is None  # noqa: E731
    assert got_lengths == want_lengths == ([7, 9, 9, 11] if device_length else [7, 10, 10, 12])
    for a, b in zip(want, got):
        assert a.shape == b.shape and a.shape[1] == ref.block_size - 1
        assert check(a, b)
    for a, b in zip((*want_cache.k, *want_cache.v), (*got_cache.k, *got_cache.v)):
        assert check(a, b)


def test_a_planted_drafter_weight_changes_the_fused_output(tiny_model_dirs):
    """A k row of the first layer (planted through k_proj, a view of the concatenated weight that
    the context's k|v GEMM reads) moves the logits past the tolerance above."""
    _, ref, fused = _drafters(tiny_model_dirs["qwen3"])
    install(fused, "torch")
    want = _draft_steps(ref, device_length=True)[0]
    with torch.no_grad():
        fused.layers[0].self_attn.k_proj.weight[0] += 0.5
    got = _draft_steps(fused, device_length=True)[0]
    assert not torch.allclose(torch.cat(want), torch.cat(got), **TOLERANCE[torch.float32])


class _Projection(torch.nn.Module):
    """A projection served by another module (as a u12 kernel is): not concatenated."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_fused_dflash_with_projections_of_other_modules(tiny_model_dirs):
    _, ref, fused = _drafters(tiny_model_dirs["llama"])
    attn, mlp = fused.layers[0].self_attn, fused.layers[0].mlp
    attn.v_proj, mlp.up_proj = _Projection(attn.v_proj), _Projection(mlp.up_proj)
    fused.encoder.fc = _Projection(fused.encoder.fc)
    stack = install(fused, "torch")
    assert stack.layers[0].qkv is None and stack.layers[0].kv is None and stack.layers[0].gate_up is None
    for a, b in zip(_draft_steps(ref, device_length=False)[0], _draft_steps(fused, device_length=False)[0]):
        torch.testing.assert_close(a, b, **TOLERANCE[torch.float32])


def test_fused_path_installs_the_dflash_drafter_once(tiny_model_dirs):
    target, _, drafter = _drafters(tiny_model_dirs["qwen3"])
    kept = []
    for _ in range(2):
        with fused_path(target, drafter):
            assert isinstance(target.fused, FusedDecoder) and isinstance(drafter.fused, FusedDFlash)
            kept.append((target.fused, drafter.fused))
        assert target.fused is None and drafter.fused is None
    assert kept[0][0] is kept[1][0] and kept[0][1] is kept[1][1]  # the weights are concatenated once



def test_fused_path_rebuilds_the_stack_after_a_projection_is_swapped(tiny_model_dirs):
    """A stack kept over the old projections must not serve new ones: after a projection of the
    model is swapped (as the weights-u12 pass's modules replace plain ones), the next fused_path
    builds the stack again over the new modules; without a swap it keeps the one it has."""
    from specpilot.runtime.model import swap_projection

    target, _, _ = _drafters(tiny_model_dirs["qwen3"])
    with fused_path(target):
        first = target.fused
    with fused_path(target):
        assert target.fused is first
    name = next(iter(target.linear_modules()))
    old = target.get_submodule(name.removesuffix(".weight"))
    swap_projection(target, name, _Projection(old))
    with fused_path(target):
        assert target.fused is not first
        assert target.fused.layers[0].qkv is None  # the swapped q_proj is no plain linear: no concatenation


def _drafts_seen(drafter) -> list[torch.Tensor]:
    """Every draft (argmax) `drafter` returns from now on, in order."""
    seen: list[torch.Tensor] = []
    drafter.register_forward_hook(lambda module, args, out: seen.append(out.argmax(-1)))
    return seen


@pytest.mark.parametrize("family,ops", [("llama", "torch"), ("qwen3", "torch"),
                                        pytest.param("qwen3", "triton", marks=INTERPRETER_ONLY)])
def test_fused_dflash_greedy_tokens_equal_ar(family, ops, tiny_model_dirs):
    """Eager and graphed DFlash loops with the fused drafter: the AR tokens, and every draft of the
    drafter's own forward (the tiny drafter's drafts are rarely accepted: the drafts themselves
    are what shows a broken drafter). The target is not fused here."""
    target, ref, fused = _drafters(tiny_model_dirs[family])
    stack = install(fused, ops)
    if ops == "torch":  # bit-exact drafts
        _unconcat(stack)
    prompt, n = [5, 9, 2, 6, 5, 3], 5 if ops == "triton" else 12
    ar = decode.generate_ar(target, prompt, max_new_tokens=n, eos_token_id=None).tokens
    want, got = _drafts_seen(ref), _drafts_seen(fused)
    for loop in (decode.generate_dflash, gd.generate_dflash_graphed):
        for drafter in (ref, fused):
            out = loop(target, drafter, prompt, block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
                       max_new_tokens=n, eos_token_id=None)
            assert out.tokens == ar
    assert len(want) > 4 and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


class _U12(torch.nn.Module):
    """A u12 projection as the backend builds one (runtime/u12 planes, the kernel's reference)."""

    def __init__(self, packed, kernel="torch"):
        super().__init__()
        self.packed, self.kernel = packed, kernel

    def forward(self, x):
        from specpilot.kernels.u12 import u12_linear_reference

        return u12_linear_reference(x.reshape(-1, x.shape[-1]), self.packed).reshape(*x.shape[:-1], -1)


def test_u12_projections_are_concatenated_over_shared_planes(tiny_model_dirs):
    """u12 q|k|v and gate|up run as one projection each, exactly the separate projections' values,
    and the original modules view the concatenated planes (no memory doubled)."""
    from specpilot.runtime.fused import FusedLayer
    from specpilot.formats.u12 import pack_u12, unpack_u12

    model, cfg = load_target(tiny_model_dirs["qwen3"]["target"], dtype=torch.bfloat16, device="cpu")
    layer = model.model.layers[0]
    names = ("q_proj", "k_proj", "v_proj")
    weights = {n: getattr(layer.self_attn, n).weight.detach().clone() for n in names}
    for n in names:
        setattr(layer.self_attn, n, _U12(pack_u12(weights[n])))
    for n in ("gate_proj", "up_proj"):
        setattr(layer.mlp, n, _U12(pack_u12(getattr(layer.mlp, n).weight.detach())))
    fl = FusedLayer(layer)
    assert fl.qkv is not None and fl.gate_up is not None
    h = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    separate = torch.cat([getattr(layer.self_attn, n)(h) for n in names], dim=-1)
    torch.testing.assert_close(fl.project_qkv(h), separate, rtol=0, atol=0)
    torch.testing.assert_close(fl.project_kv(h), separate[:, cfg.num_heads * cfg.head_dim:], rtol=0, atol=0)
    fused_sm = fl.qkv.packed.sm
    for n in names:  # the same bits, now over the concatenated planes
        packed = getattr(layer.self_attn, n).packed
        assert torch.equal(unpack_u12(packed).view(torch.int16), weights[n].view(torch.int16))
        assert fused_sm.untyped_storage().data_ptr() == packed.sm.untyped_storage().data_ptr()


# --- fused_linear: the norms, SiLU·mul and residual adds inside the GEMMs ---------------------

def _count_linear(stack, field: str = "linear") -> list[tuple[bool, bool, bool]]:
    """(norm prologue, gated, residual epilogue) of every call `stack` makes from now on to its
    ops' `field` (fused_linear, or linear_u12)."""
    calls: list[tuple[bool, bool, bool]] = []
    linear = getattr(stack.ops, field)

    def counted(x, w, *, norm_weight=None, eps=1e-6, gated=False, residual=None, **kw):
        calls.append((norm_weight is not None, gated, residual is not None))
        return linear(x, w, norm_weight=norm_weight, eps=eps, gated=gated, residual=residual, **kw)

    stack.ops = dataclasses.replace(stack.ops, **{field: counted})
    return calls


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_layers_match_the_unfused_stack(family, dtype, tiny_model_dirs):
    """The rows linear_serves takes (1, 5..16 and 32 by default) run fused_linear (4 calls a layer: qkv
    with the input norm, o into the stream, gate|up with the post-attention norm and SiLU·mul, down
    into the stream); other rows (2) run the kernels one by one. Logits, picked hidden states and
    caches as the unfused stack's."""
    _, plain, cfg = _pair(tiny_model_dirs[family], dtype)
    _, fused, _ = _pair(tiny_model_dirs[family], dtype)
    unfused = install(plain, "torch")
    unfused.ops = dataclasses.replace(unfused.ops, linear_max_m=0)
    calls = _count_linear(install(fused, "torch"))
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    layers = (0, cfg.num_layers - 1)
    c_plain, c_fused = plain.new_cache(1, 24, device_length=True), fused.new_cache(1, 24, device_length=True)
    for chunk in (ids, ids[:, :1], ids[:, 1:3]):
        calls.clear()
        a = plain(chunk, c_plain, hidden_layers=layers)
        b = fused(chunk, c_fused, hidden_layers=layers)
        rows = chunk.shape[1]
        served = fused.fused.ops.linear_serves(rows, u12=False)
        assert served == (rows != 2)
        assert calls == ([(True, False, False), (False, False, True), (True, True, False), (False, False, True)]
                         * cfg.num_layers if served else [])
        assert_close(a.logits, b.logits, dtype)
        assert_close(a.hidden, b.hidden, dtype)
    for i in range(cfg.num_layers):
        assert_close(c_plain.k[i], c_fused.k[i], dtype)


@interpreter_only
def test_row_squares_carry_each_norm_from_the_residual_epilogue_before_it(tiny_model_dirs):
    """At several rows (the dot kernel, under the interpreter) every norm but the first layer's
    input norm takes its sums of squares from the o or down epilogue before it (RowSquares): the
    logits match the unfused stack's and the stack's without the hand-off."""
    _, plain, cfg = _pair(tiny_model_dirs["llama"], torch.float32)
    unfused = install(plain, "torch")
    unfused.ops = dataclasses.replace(unfused.ops, linear_max_m=0)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    want = plain(ids, plain.new_cache(1, 16)).logits
    for row_squares in (True, False):
        _, fused, _ = _pair(tiny_model_dirs["llama"], torch.float32)
        stack = install(fused, "triton")
        stack.ops = dataclasses.replace(stack.ops, linear_max_m=16, row_squares=row_squares)
        read = []
        linear = stack.ops.linear

        def spy(x, w, *, norm_weight=None, squares=None, **kw):
            if norm_weight is not None:
                read.append(squares is not None and squares.readable(x))
            return linear(x, w, norm_weight=norm_weight, squares=squares, **kw)

        stack.ops = dataclasses.replace(stack.ops, linear=spy)
        got = fused(ids, fused.new_cache(1, 16)).logits
        assert read == ([False] + [True] * (2 * cfg.num_layers - 1) if row_squares else [False] * 2 * cfg.num_layers)
        torch.testing.assert_close(got, want, **TOLERANCE[torch.float32])


def test_fused_linear_serves_plain_and_u12_weights_only(tiny_model_dirs):
    """A projection served by another module (neither nn.Linear nor u12) keeps the layer on the
    unfused kernels."""
    _, fused, _ = _pair(tiny_model_dirs["llama"], torch.float32)
    fused.model.layers[0].mlp.down_proj = _Projection(fused.model.layers[0].mlp.down_proj)
    stack = install(fused, "torch")
    kernel = stack.ops.u12_kernel
    assert stack.layers[0].linear_weights(kernel) is None and stack.layers[1].linear_weights(kernel) is not None
    calls = _count_linear(stack)
    fused(torch.tensor([[3]]), fused.new_cache(1, 8))
    assert calls == []


@pytest.mark.slow
@interpreter_only
@pytest.mark.parametrize("family", FAMILIES)
def test_fused_linear_greedy_tokens_equal_ar(family, tiny_model_dirs):
    """The AR loop (one row a step: all fused_linear) gives the AR greedy tokens, with the kernels
    under the interpreter. The graphed DFlash loop on the same Triton stack (its verify rows
    unfused, its bonus and single-row steps fused): test_fused_triton_kernels_in_a_graphed_dflash_loop."""
    ref, fused, cfg = _pair(tiny_model_dirs[family], torch.float32)
    calls = _count_linear(install(fused, "triton"))
    prompt = [5, 9, 2, 6, 5, 3]
    ar = decode.generate_ar(ref, prompt, max_new_tokens=3, eos_token_id=None).tokens
    assert decode.generate_ar(fused, prompt, max_new_tokens=3, eos_token_id=None).tokens == ar
    assert len(calls) >= 2 * cfg.num_layers * 4  # two one-row steps (the second after one), four linears a layer


def _count_calls(stack, field: str) -> list[int]:
    """The T of every call of ops.`field` that `stack` makes from now on."""
    calls: list[int] = []
    fn = getattr(stack.ops, field)

    def counted(qkv, *args, **kw):
        calls.append(qkv.shape[1])
        return fn(qkv, *args, **kw)

    stack.ops = dataclasses.replace(stack.ops, **{field: counted})
    return calls


@pytest.mark.slow
@interpreter_only
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_attention_serves_split_kv_layers(family, tiny_model_dirs):
    """Under fused_path (the split-KV kernel in every layer) the Triton ops run each layer's RoPE,
    cache write and attention as one rope_attention call, at one row and at several: logits,
    hidden states and caches bit for bit those of rope_qkv then the split-KV kernel (within fp32
    rounding with qk-norm); the graphed
    DFlash loop (its drafter's block too; rope_qkv left for the drafter's context) gives the AR
    tokens (qwen3). The comparison runs the layers' other ops (fused_linear, rmsnorm, silu_mul) as
    their references, the same in both runs (under the interpreter fused_linear's one-row GEMVs took
    most of its time: 3.3 s against 0.4 s a one-row forward); the loop runs every Triton op."""
    from specpilot.backends.kernel_hooks import fused_ops

    dirs = tiny_model_dirs[family]
    ref, fused, cfg = _pair(dirs, torch.float32)
    drafter = load_drafter(dirs["dflash"], fused, cfg, dtype=torch.float32, device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    layers = (0, cfg.num_layers - 1)
    references = fused_ops("torch")
    with fused_path(fused, drafter), torch.inference_mode():
        stack = fused.fused
        ops = stack.ops
        attention_only = dataclasses.replace(ops, linear=references.linear, rmsnorm=references.rmsnorm,
                                             silu_mul=references.silu_mul)
        results = {}
        for label in ("apart", "one launch"):
            stack.ops = attention_only if label == "one launch" else dataclasses.replace(attention_only,
                                                                                          rope_attention=None)
            together, apart = _count_calls(stack, "rope_attention") if label == "one launch" else [], _count_calls(stack, "rope_qkv")
            cache = fused.new_cache(1, 24, device_length=True)
            out = [fused(chunk, cache, hidden_layers=layers) for chunk in (ids, ids[:, :1], ids[:, 1:4])]
            results[label] = (out, cache)
        assert together == [9] * cfg.num_layers + [1] * cfg.num_layers + [3] * cfg.num_layers and apart == []
        # qk-norm's Σx² of a head is reduced in another order (kernels/rope_attention.py): fp32 rounding
        same = torch.equal if not cfg.qk_norm else lambda x, y: torch.allclose(x, y, **TOLERANCE[torch.float32])
        for a, b in zip(*(results[k][0] for k in ("apart", "one launch"))):
            assert same(a.logits, b.logits) and all(same(x, y) for x, y in zip(a.hidden, b.hidden))
        for x, y in zip(results["apart"][1].k + results["apart"][1].v, results["one launch"][1].k + results["one launch"][1].v):
            assert same(x, y)
        stack.ops = ops
        if cfg.qk_norm:  # the graphed loop once (qk-norm: the most the kernel does), to keep CI short
            context = _count_calls(drafter.fused, "rope_qkv")
            blocks = _count_calls(drafter.fused, "rope_attention")
            prompt = [5, 9, 2, 6, 5, 3]
            out = gd.generate_dflash_graphed(fused, drafter, prompt, block_size=drafter.block_size,
                                             mask_token_id=drafter.mask_token_id, max_new_tokens=4, eos_token_id=None)
            assert out.tokens == decode.generate_ar(ref, prompt, max_new_tokens=4, eos_token_id=None).tokens
            assert context and blocks and set(blocks) == {drafter.block_size}


# --- u12 layers: u12_fused_linear at one row -----------------------------------------------------

_PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def _to_u12(model, kernel: str):
    """Every layer projection of `model` (bf16) as a u12 module of `kernel`, as weights-u12 builds them."""
    from specpilot.formats.u12 import pack_u12

    for layer in model.model.layers:
        for part, name in _PROJECTIONS:
            owner = getattr(layer, part)
            setattr(owner, name, _U12(pack_u12(getattr(owner, name).weight.detach()), kernel))
    return model


_LAYER_CALLS = [(True, False, False), (False, False, True), (True, True, False), (False, False, True)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("norms_apart,handoff", [(False, False), (True, False), (True, True)],
                         ids=["norm-prologue", "norms-apart", "norms-handed-on"])
def test_u12_layers_run_the_fused_u12_linear(family, norms_apart, handoff, tiny_model_dirs):
    """On by default with the norms apart (the H200's faster u12 AR step), at one row layers whose
    projections are u12 modules of the kernel the ops stand in for run ops.linear_u12 (4 calls a layer, as
    fused_linear's; with the norms apart, qkv and gate|up without the norm, two rmsnorm calls a
    layer instead; with the norms handed on, o and down hand theirs to the GEMV after them, so the
    only rmsnorm calls are the first layer's input norm and the final one): the logits, hidden
    states and caches of the unfused u12 stack; with more rows, or modules of another kernel, the
    layers stay unfused."""
    _, plain, cfg = _pair(tiny_model_dirs[family], torch.bfloat16)
    _, fused, _ = _pair(tiny_model_dirs[family], torch.bfloat16)
    unfused = install(_to_u12(plain, "torch"), "torch")
    assert (unfused.ops.u12_kernel, unfused.ops.u12_norms_apart) == ("torch", True)  # the default
    assert all(fl.linear_weights(unfused.ops.u12_kernel) is not None for fl in unfused.layers)
    unfused.ops = dataclasses.replace(unfused.ops, linear_max_m=0, u12_kernel="")
    stack = install(_to_u12(fused, "torch"), "torch")
    stack.ops = dataclasses.replace(stack.ops, u12_kernel="torch", u12_norms_apart=norms_apart,
                                    u12_norm_handoff=handoff, u12_many_rows=0)  # rows above 4: test_u12_layers_at_many_rows
    calls, plain_calls = _count_linear(stack, "linear_u12"), _count_linear(stack)
    hands = []
    linear_u12 = stack.ops.linear_u12
    stack.ops = dataclasses.replace(stack.ops, linear_u12=lambda *a, hand_in=None, hand_out=None, **kw: (
        hands.append((hand_in is not None, hand_out is not None)),
        linear_u12(*a, hand_in=hand_in, hand_out=hand_out, **kw))[1])
    expected = [(norm and not norms_apart, gated, residual) for norm, gated, residual in _LAYER_CALLS]
    # (hand_in, hand_out) of qkv, o, gate|up and down: o hands to gate|up, down to the next layer's qkv
    expected_hands = [[(i > 0, False), (False, True), (True, False), (False, i + 1 < cfg.num_layers)]
                      if handoff else [(False, False)] * 4 for i in range(cfg.num_layers)]
    norms, rmsnorm = [], stack.ops.rmsnorm
    stack.ops = dataclasses.replace(stack.ops, rmsnorm=lambda *a, **kw: (norms.append(1), rmsnorm(*a, **kw))[1])
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(3))
    layers = (0, cfg.num_layers - 1)
    c_plain, c_fused = plain.new_cache(1, 24, device_length=True), fused.new_cache(1, 24, device_length=True)
    for chunk in (ids, ids[:, :1], ids[:, 1:3], ids[:, 3:4]):
        calls.clear()
        norms.clear()
        hands.clear()
        a = plain(chunk, c_plain, hidden_layers=layers)
        b = fused(chunk, c_fused, hidden_layers=layers)
        assert calls == (expected * cfg.num_layers if chunk.shape[1] == 1 else [])
        assert hands == ([h for layer in expected_hands for h in layer] if chunk.shape[1] == 1 else [])
        if chunk.shape[1] == 1:  # the final norm, and the layers' two where apart (the first layer's alone handed on)
            assert len(norms) == 1 + (1 if handoff else 2 * cfg.num_layers * norms_apart)
        # Handed on, the norms round elsewhere (NormHandoff), and the steps compound through these
        # random layers: on the llama pair the first layer's stream is within 0.25 of |h| ~ 12 (mean
        # 0.05, under one bf16 step), the last's within 0.875 of ~ 18, the logits within 0.094 of ~ 7;
        # apart, all equal. A norm scale lost or wrong moves them by whole units.
        tol = dict(rtol=5e-2, atol=0.125) if handoff else TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(a.logits, b.logits, **tol)
        torch.testing.assert_close(a.hidden, b.hidden, **(dict(rtol=5e-2, atol=1.0) if handoff else tol))
        assert torch.equal(a.logits[:, -1].argmax(-1), b.logits[:, -1].argmax(-1))
    assert plain_calls == []
    for i in range(cfg.num_layers):
        torch.testing.assert_close(c_plain.k[i], c_fused.k[i], **(dict(rtol=5e-2, atol=0.25) if handoff else tol))
    # modules of the Triton kernel: not what torch ops stand in for
    other = install(_to_u12(_pair(tiny_model_dirs[family], torch.bfloat16)[1], "triton-u12"), "torch")
    assert all(fl.linear_weights("torch") is None for fl in other.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_u12_layers_at_many_rows(family, tiny_model_dirs):
    """Up to ops.u12_many_rows rows (16 by default; 0: none), u12 layers run ops.linear_u12 above
    GEMV_ROWS rows too (a 9-token chunk: the mma and hmma kernels' epilogues), the norms handed on as
    at one row; 2..4 rows stay unfused. The logits, hidden states and caches are the unfused u12
    stack's, within the handoff's roundings. A bool for the row count is refused."""
    _, plain, cfg = _pair(tiny_model_dirs[family], torch.bfloat16)
    _, fused, _ = _pair(tiny_model_dirs[family], torch.bfloat16)
    unfused = install(_to_u12(plain, "torch"), "torch")
    unfused.ops = dataclasses.replace(unfused.ops, linear_max_m=0, u12_kernel="")
    stack = install(_to_u12(fused, "torch"), "torch")
    assert stack.ops.u12_many_rows == 16 and stack.ops.linear_serves(16, u12=True)  # the default: up to 16
    assert not stack.ops.linear_serves(17, u12=True) and not stack.ops.linear_serves(3, u12=True)
    assert not dataclasses.replace(stack.ops, u12_many_rows=0).linear_serves(9, u12=True)
    with pytest.raises(ValueError, match="FusedOps.u12_many_rows: expected a row count"):
        dataclasses.replace(stack.ops, u12_many_rows=True)
    stack.ops = dataclasses.replace(stack.ops, u12_many_rows=stack.ops.linear_max_m)
    assert stack.ops.linear_serves(9, u12=True) and not stack.ops.linear_serves(3, u12=True)
    # fused_linear's gap (17..31 rows: its tiles against cuBLAS's) is not the u12 kernels'
    assert stack.ops.linear_serves(17, u12=True) and not stack.ops.linear_serves(17, u12=False)
    assert not stack.ops.linear_serves(stack.ops.linear_max_m + 1, u12=True)
    hands = []
    linear_u12 = stack.ops.linear_u12
    stack.ops = dataclasses.replace(stack.ops, linear_u12=lambda x, *a, hand_in=None, hand_out=None, **kw: (
        hands.append((x.shape[0], hand_in is not None, hand_out is not None)),
        linear_u12(x, *a, hand_in=hand_in, hand_out=hand_out, **kw))[1])
    norms, silus, rmsnorm, silu_mul = [], [], stack.ops.rmsnorm, stack.ops.silu_mul
    stack.ops = dataclasses.replace(stack.ops, rmsnorm=lambda *a, **kw: (norms.append(1), rmsnorm(*a, **kw))[1],
                                    silu_mul=lambda *a, **kw: (silus.append(1), silu_mul(*a, **kw))[1])
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(4))
    layers = (0, cfg.num_layers - 1)
    c_plain, c_fused = plain.new_cache(1, 24, device_length=True), fused.new_cache(1, 24, device_length=True)
    tol = dict(rtol=5e-2, atol=0.125)  # the handoff's roundings (test_u12_layers_run_the_fused_u12_linear)
    for chunk in (ids[:, :9], ids[:, 9:11], ids[:, 11:12]):
        hands.clear()
        norms.clear()
        silus.clear()
        a = plain(chunk, c_plain, hidden_layers=layers)
        b = fused(chunk, c_fused, hidden_layers=layers)
        rows = chunk.shape[1]
        if rows not in (2, 3, 4):  # the first layer's input norm and the final one; no SiLU·mul launch
            assert (len(norms), len(silus)) == (2, 0)
        expected = [] if rows in (2, 3, 4) else [
            (rows, i > 0, False) if j == 0 else (rows, False, True) if j == 1 else (rows, True, False) if j == 2
            else (rows, False, i + 1 < cfg.num_layers) for i in range(cfg.num_layers) for j in range(4)]
        assert hands == expected
        torch.testing.assert_close(a.logits, b.logits, **tol)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=5e-2, atol=1.0)
        top2 = a.logits.float().topk(2, dim=-1).values
        clear = (top2[..., 0] - top2[..., 1]) > 0.25  # no near-tie within the roundings: the same token
        assert torch.equal(a.logits.argmax(-1)[clear], b.logits.argmax(-1)[clear]) and clear.any()
    for i in range(cfg.num_layers):
        torch.testing.assert_close(c_plain.k[i], c_fused.k[i], rtol=5e-2, atol=0.25)


@pytest.mark.slow
@interpreter_only
def test_u12_fused_linear_greedy_tokens_equal_the_unfused_u12_stack(tiny_model_dirs):
    """The AR loop with u12 layers and u12_fused_linear under the interpreter gives the tokens of
    the same u12 model on the unfused kernels' references (token forcing judges near-ties): with
    ops.u12_many_rows the 6-token prompt's forward runs it too (the mma and hmma epilogues), then
    one one-row step; without, the prompt's forward runs the unfused u12_linear kernels and gives
    the first token. The one-row step is the same launch at either setting (u12_many_rows acts above
    GEMV_ROWS rows only), so it runs once."""
    from specpilot.validate.forcing import check_prompt

    dirs = tiny_model_dirs["qwen3"]
    _, ref, cfg = _pair(dirs, torch.bfloat16)
    _, fused, _ = _pair(dirs, torch.bfloat16)
    unfused = install(_to_u12(ref, "torch"), "torch")
    unfused.ops = dataclasses.replace(unfused.ops, linear_max_m=0)
    stack = install(_to_u12(fused, "triton-u12"), "triton")
    stack.ops = dataclasses.replace(stack.ops, u12_kernel="triton-u12")
    calls = _count_linear(stack, "linear_u12")
    prompt = [5, 9, 2, 6, 5, 3]
    # the prompt's forward, then one one-row step through u12_fused_linear in every layer (the
    # suite's slowest test at more under the interpreter; the registry cases check the kernel)
    want = decode.generate_ar(ref, prompt, max_new_tokens=2, eos_token_id=None).tokens
    for many_rows, new_tokens in ((0, 1), (16, 2)):
        stack.ops = dataclasses.replace(stack.ops, u12_many_rows=many_rows)
        calls.clear()
        got = decode.generate_ar(fused, prompt, max_new_tokens=new_tokens, eos_token_id=None).tokens
        assert len(calls) == 4 * len(fused.model.layers) * (new_tokens if many_rows else 0), many_rows
        assert got == want[:new_tokens] or not check_prompt(ref, cfg, prompt, got, "bfloat16").hard_failures


@pytest.mark.parametrize("u12", [True, False], ids=["u12", "bf16"])
def test_u12_forwards_of_few_rows_take_the_u12_launch(u12, tiny_model_dirs):
    """FusedOps.u12_launch (kernel_hooks.U12_LAUNCH: PDL mode 2) is the launch of a u12 stack's
    forwards of u12_launch_rows rows or fewer (32; 4 here): every kernel call of the layers, the u12
    projections the fused linear does not serve (3 rows) and the final norm get it; more rows, or
    plain weights, get ops.launch. kernel_hooks.with_launch sets both for a benchmark."""
    from specpilot.backends.kernel_hooks import U12_LAUNCH, fused_ops, with_launch
    from specpilot.kernels.overlap import Launch

    _, model, cfg = _pair(tiny_model_dirs["llama"], torch.bfloat16)
    stack = install(_to_u12(model, "torch") if u12 else model, "torch")
    assert stack.ops.launch is None and stack.ops.u12_launch is None  # the references launch nothing
    triton_ops = fused_ops("triton")
    assert (triton_ops.launch, triton_ops.u12_launch, triton_ops.u12_launch_rows) == (Launch(), U12_LAUNCH, 32)
    assert U12_LAUNCH == Launch(pdl=2)
    assert with_launch(triton_ops, Launch(pdl=1)).launch_for(5, serves_u12=True) == Launch(pdl=1)
    plain, few, seen = Launch(), Launch(pdl=2), []

    def spy(fn):
        return lambda *a, **kw: (seen.append(kw["launch"]), fn(*a, **kw))[1]

    ops = stack.ops
    stack.ops = dataclasses.replace(ops, launch=plain, u12_launch=few, u12_launch_rows=4, rmsnorm=spy(ops.rmsnorm),
                                    silu_mul=spy(ops.silu_mul), rope_qkv=spy(ops.rope_qkv), linear=spy(ops.linear),
                                    linear_u12=spy(ops.linear_u12), u12_project=spy(ops.u12_project))
    assert stack.serves_u12() == u12
    cache = model.new_cache(1, 24, device_length=True)
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    for chunk, want in ((ids[:, :5], plain), (ids[:, 5:6], few if u12 else plain), (ids[:, 6:9], few if u12 else plain)):
        seen.clear()
        model(chunk, cache)
        assert seen and set(seen) == {want}
