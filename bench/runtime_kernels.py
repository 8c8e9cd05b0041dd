"""Kernel counts of the project's runtime steps at Llama-3.1-8B shape (as bench/step_times.py builds
them), and the cost of a host round trip (what an accept on the host pays per step)."""
import importlib.util, json, os, statistics, sys
import torch
from torch.profiler import profile, ProfilerActivity
sys.path.insert(0, os.getcwd())
spec = importlib.util.spec_from_file_location("st", "bench/step_times.py")
st = importlib.util.module_from_spec(spec); spec.loader.exec_module(st)
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import Transformer

def kernels(fn):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(); torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(names), names

out = {}
with torch.inference_mode():
    name = "llama-3.1-8b"
    cfg = ModelConfig.from_hf(st.SHAPES[name], name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg).to(torch.bfloat16)
    st.random_(model)
    cache = model.new_cache(1, 512 + 128)
    for q in (1, 16):
        ids = torch.randint(0, cfg.vocab_size, (1, q), device="cuda")
        def step(ids=ids):
            cache.length = 512
            return model(ids, cache)
        n, names = kernels(step)
        out[f"target_q{q}"] = n
        if q == 16:
            from collections import Counter
            out["target_q16_top"] = Counter(n.split("<")[0][:60] for n in names).most_common(25)
    dcfg = DrafterConfig.from_hf({**st.SHAPES[name], "num_hidden_layers": 5, "block_size": 16, "mask_token_id": cfg.vocab_size - 1,
                                  "target_layer_ids": [1, 8, 16, 24, 31]}, name + "-dflash")
    with torch.device("cuda"):
        drafter = DFlashDrafter(dcfg, model.embed, model.head).to(torch.bfloat16)
    st.random_(drafter)
    dcache = drafter.new_cache(1, 512 + 128)
    block = torch.full((1, 16), dcfg.mask_token_id, device="cuda")
    ctx = torch.randn(1, 4, 5 * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    def draft():
        dcache.length = 512
        return drafter(block, ctx, dcache)
    out["draft_q16"] = kernels(draft)[0]
    # host round trip: greedy accept on the host (D2H of q ids, compare, H2D of the accepted count)
    a = torch.randint(0, 1000, (16,), device="cuda"); b = a.clone()
    def roundtrip():
        x, y = a.tolist(), b.tolist()
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        return torch.tensor([n], device="cuda")
    ts = []
    for i in range(200):
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True); t1 = torch.cuda.Event(enable_timing=True)
        import time; w0 = time.perf_counter(); roundtrip(); torch.cuda.synchronize(); ts.append(time.perf_counter() - w0)
    out["host_roundtrip_us_median"] = statistics.median(ts[20:]) * 1e6
print(json.dumps(out, indent=1))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "runtime_kernels.json"), "w"), indent=1)
