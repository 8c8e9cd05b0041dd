"""The compile driver: spec -> IR -> passes -> engine -> token forcing -> engine directory.

    spec = load_spec("pipeline.yaml")
    result = compile_pipeline(spec, out_dir=Path("engines/demo"))

Each stage is the owner room's code; this module only strings them together and measures.
"""

from __future__ import annotations

import functools
import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from . import __version__
from .backends.engine_dir import (ENGINE_FORMAT, atomic_dir, check_compatible, copy_checkpoint, read_tuning, write_manifest,
                                   write_tuning)
from .backends.torch_backend import (U12_FILE, Engine, ReplaySetup, ShapeModels, build_engine, default_dtype,
                                     drafter_root, packed_weights, pick_device, stored_weights)
from .bench.batch import measure_batches, measure_served
from .bench.harness import Measurement, device_name, environment, gpu_slug, measure, versions
from .bench.prompts import load_prompts
from .dsl import load_rules, parse_pipeline
from .dsl.pipeline import pass_names
from .errors import CheckpointError, EngineError, PipelineError, SpecError, UnpricedError, WeightsWrittenError
from .hf.checkpoint import CONFIG, check_layer_count, read_config, read_header, weight_files
from .hf.known import dflash_config, model_config, pard_config
from .ir import MATMUL_OPS, Program, limits, lower, print_program
from .ir.node import SHARED
from .passes import PassRecord, pipeline_string, run_passes
from .passes.what_if import what_ifs
from .passes.base import Pass, lookup
from .passes.plugins import load_distribution, load_module, load_weight_format
from .runtime.builtin import is_builtin, resolve_builtin
from .runtime.draft_vocab import VOCAB_FILE, DraftVocab, save_vocab
from .runtime.load import load_target
from .runtime.shared_weights import private_weights, sharing_weights
from .runtime.shared_weights import written as weights_written
from .runtime.tokenizer import load_chat_template, load_tokenizer
from .formats.u12 import save_u12
from .spec import PipelineSpec
from .validate.forcing import TokenForcingReport, force_tokens


@dataclass(frozen=True)
class ModelDirs:
    target: Path | None
    drafter: Path | None
    shape: ShapeModels | None = None  # a target given by shape: random weights, a replay drafter, no directories

    @property
    def tokenizer(self):
        """The prompts' tokenizer: the target directory's, or the byte tokenizer of a target by shape."""
        return self.shape.tokenizer() if self.shape else load_tokenizer(self.target)


def shape_models(spec: PipelineSpec) -> ShapeModels:
    """The target `spec` gives by shape and its replay drafter's network (hf/known.py's recipes)."""
    shape, d = spec.target_shape.shape, spec.drafter
    drafter_cfg = dflash_config(shape) if d.shape == "dflash" else pard_config(shape)
    return ShapeModels(model_config(shape), drafter_cfg, ReplaySetup(d.profile, d.benchmark, d.seed),
                       seed=spec.target_shape.seed)


def resolve_models(spec: PipelineSpec) -> ModelDirs:
    if spec.target_shape is not None:
        return ModelDirs(None, None, shape_models(spec))
    target = resolve_builtin(spec.target) if is_builtin(spec.target) else Path(spec.target)
    if spec.drafter.path:
        d = spec.drafter.path
        drafter = resolve_builtin(d) if is_builtin(d) else Path(d)
    elif is_builtin(spec.target):
        drafter = resolve_builtin(f"{spec.target}/{spec.drafter.kind}")
    else:
        raise CheckpointError(f"{spec.source}: missing field 'drafter.path' (a local drafter directory)")
    for what, path in (("target", target), ("drafter.path", drafter)):
        if not _is_file(path / CONFIG):
            shown = str(path) if len(str(path)) <= 80 else str(path)[:77] + "..."
            raise CheckpointError(f"{spec.source}: field '{what}': {shown!r} is not a model directory (no config.json)")
    return ModelDirs(target, drafter)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name no file system takes (too long, NUL bytes): no file
        return False


def lower_spec(spec: PipelineSpec, dirs: ModelDirs, dtype: str) -> Program:
    """The spec's deployment as a verified program. The configs are checked against the weights
    their directories hold, from the safetensors headers: the layer count before anything is lowered
    (a config claiming ten million layers is no graph to build), every named weight's shape after.
    A target by shape lowers from hf/known.py's configs; its draft node names the replay's profile."""
    block_source = f"{spec.source}: field 'drafter.block_size'"
    if dirs.shape is not None:
        program = lower(dirs.shape.target_cfg, dirs.shape.drafter_cfg, dtype=dtype, block_size=spec.drafter.block_size,
                        target_source=f"{spec.source}: field 'target.shape'",
                        drafter_source=f"{spec.source}: field 'drafter.shape'", block_source=block_source,
                        batch=max(spec.serving.batch_sizes))
        name, draft = program.step.one("draft")
        replay = dirs.shape.replay
        return program.with_graph("step", program.step.with_node(
            name, draft.replace(drafter=f"replay:{replay.profile}/{replay.benchmark}")))
    (target, target_source), (drafter, drafter_source) = read_config(dirs.target), read_config(dirs.drafter)
    for root, cfg, source in ((dirs.target, target, target_source), (dirs.drafter, drafter, drafter_source)):
        check_layer_count(root, cfg, source)
    program = lower(target, drafter, dtype=dtype, block_size=spec.drafter.block_size, target_source=target_source,
                    drafter_source=drafter_source, block_source=block_source, batch=max(spec.serving.batch_sizes))
    check_weight_shapes(program, dirs, {"target": target_source, "drafter": drafter_source})
    kind = program.step.one("draft")[1]["kind"]
    if kind != spec.drafter.kind:
        raise CheckpointError(f"{spec.source}: field 'drafter.kind' is {spec.drafter.kind!r} but "
                              f"{dirs.drafter / 'config.json'} describes a {kind} drafter")
    return program


def _weight_shape(node) -> list[int] | None:
    """The shape the checkpoint must give the weight a model-graph node reads (None: not one it names)."""
    if node.op in MATMUL_OPS:
        return [node["out_features"], node["in_features"]]
    if node.op == "embed":
        return [node["vocab"], node["dim"]]
    if node.op == "rmsnorm":
        return [node["dim"]]
    return None


def check_weight_shapes(program: Program, dirs: ModelDirs, sources: dict[str, str]) -> None:
    """CheckpointError unless every weight the lowered graphs name is in its directory's safetensors
    with the shape its config implies: read from the headers, before the runtime builds modules of
    the sizes a config claims."""
    for level, root in (("target", dirs.target), ("drafter", dirs.drafter)):
        files, headers = weight_files(root), {}
        for _, node in program.graph(level).items():
            weight, shape = node.get("weight"), _weight_shape(node)
            if shape is None or not isinstance(weight, str) or weight.startswith(SHARED):
                continue
            if weight not in files:
                raise CheckpointError(f"{sources[level]}: describes a weight {weight!r} that no safetensors file in "
                                      f"{root} holds")
            path = files[weight]
            if path not in headers:
                headers[path] = read_header(path)
            if weight not in headers[path]:
                raise CheckpointError(f"{path}: tensor {weight!r} is missing (the index lists it in this file)")
            if headers[path][weight]["shape"] != shape:
                raise CheckpointError(f"{path}: tensor {weight!r} has shape {headers[path][weight]['shape']}; "
                                      f"{sources[level]} makes it {shape}")


def pipeline_source(spec: PipelineSpec, override: str | None) -> str:
    """Where the pipeline comes from, as errors name it: --passes, or the spec's field."""
    return "--passes" if override is not None else f"{spec.source}: field 'passes'"


def load_plugins(spec: PipelineSpec) -> None:
    """Import the plugins the spec names (trusted code the user chose): local module files, and
    installed plugin distributions by name."""
    where = f"{spec.source}: field 'plugins': "
    for plugin in spec.plugins:
        if not plugin.endswith(".py"):
            load_distribution(plugin, where)
        elif not _is_file(Path(plugin)):
            raise SpecError(f"{where}no such file {plugin[:80]!r} (expected a Python module file)")
        else:
            load_module(Path(plugin), where)


def resolve_passes(spec: PipelineSpec, override: str | None) -> list[Pass]:
    """The spec's pass pipeline (or `override`, from --passes): its plugins and rules files loaded,
    then the string parsed; a pass no one registered is looked up among the installed plugins."""
    load_plugins(spec)
    for rules in spec.rules:
        if not _is_file(Path(rules)):
            raise SpecError(f"{spec.source}: field 'rules': no such file {rules[:80]!r} (expected a rules file)")
        load_rules(Path(rules), source=rules)
    text = spec.passes if override is None else override
    return parse_pipeline(text, source=pipeline_source(spec, override), plugins=True)


def refuse_written_weights() -> None:
    """WeightsWrittenError where an engine built or run in this `sharing_weights` scope wrote into the
    weights token forcing's reference shares (the scope then forgets them: the next build makes them afresh)."""
    changed = weights_written()
    if changed:
        raise WeightsWrittenError(f"the engine wrote into the target's weights in place ({', '.join(changed[:3])}): "
                                  "token forcing's reference shares them, so it cannot judge this engine")


def validate_outputs(dirs: ModelDirs, engine: Engine, m: Measurement) -> TokenForcingReport:
    """Token forcing against the unmodified target (its checkpoint, or rebuilt from its shape and
    seed), on every output token. In a `sharing_weights` scope the reference reads the weights the
    engine left unchanged: refused (refuse_written_weights) where the engine wrote into them."""
    from .backends.torch_backend import TORCH_DTYPES

    dtype = TORCH_DTYPES[engine.dtype]
    refuse_written_weights()
    if dirs.shape is not None:
        reference, ref_cfg = dirs.shape.target(dtype, engine.device)
    else:  # an engine's checkpoint: the weights its u12 planes hold, unpacked bit for bit
        reference, ref_cfg = load_target(dirs.target, dtype=dtype, device=engine.device,
                                         stored=stored_weights(dirs.target, engine.device))
    return force_tokens(reference, ref_cfg, m.prompts, m.spec_tokens, engine.dtype)


def predicted_batches(program: Program, gpu: str, sizes, tau: float, rows: list[dict]) -> dict:
    """The cost model's batch terms beside the measured rows: tokens/s per concurrency, and where the
    engine profiled a step-cost table, its verify times against the predicted ones."""
    from .cost import AcceptanceModel
    from .cost.batch import batch_rows, compare_cost_table, verify_cost_table
    from .cost.gaps import draft_positions
    from .cost.gpu import load_gpu

    k = draft_positions(program)
    out = {"gpu": gpu, "rows": batch_rows(program, gpu, sizes, AcceptanceModel.from_tau(max(1.0, min(tau, k + 1.0)), k),
                                          dtype=str(program.attr("dtype"))),
           "note": "predicted by the roofline for the spec's GPU (eager steps); measured tables are this machine's"}
    checks = {}
    for row in rows:
        measured = {int(t): ms for t, ms in row.get("measured_verify_ms", {}).items()}
        if measured:
            predicted = verify_cost_table(program, load_gpu(gpu), row["concurrency"], sorted(measured),
                                          dtype=str(program.attr("dtype")))
            checks[row["concurrency"]] = compare_cost_table(predicted, measured)
    if checks:
        out["verify_cost_check"] = checks
    return out


def write_cost_view(program: Program, gpu: str, tau: float, report: dict, root: Path) -> None:
    """The cost model's view of the engine on its target GPU (τ as measured here): into the
    report, and as a roofline/gap chart beside it."""
    from .cost import Workload, explain, plot_gaps

    try:
        estimate = explain(program, gpu, Workload(tau=tau), what_ifs=what_ifs)
    except UnpricedError as e:  # a plugin's format the cost model cannot price: the engine is measured only
        report["cost_model"] = {"gpu": gpu, "not_predicted": str(e)}
        return
    report["cost_model"] = estimate.to_dict()
    plot_gaps(estimate, root / "explain.png")


def write_trtllm(root: Path, dirs: ModelDirs, engine: Engine, program: Program, prompts: list[list[int]],
                 spec: PipelineSpec) -> dict:
    """The TensorRT-LLM artifacts (backends/trtllm.py) under root/trtllm, read back and token-forced
    against the unmodified target; an EngineError (nothing written) when that fails."""
    from .backends import trtllm
    from .backends.torch_backend import TORCH_DTYPES

    out = root / trtllm.TRTLLM_DIR
    draft = program.step.one("draft")[1]
    info = trtllm.write_artifacts(out, dirs.target, dirs.drafter, block_size=draft["block_size"])
    reference = trtllm.reference_target(dirs.target, dtype=TORCH_DTYPES[engine.dtype], device=engine.device)
    check = trtllm.check_checkpoint(out, reference, prompts, max_new_tokens=spec.serving.max_new_tokens,
                                    eos_token_id=engine.target_cfg.eos_token_id, k=draft["block_size"],
                                    mask_token_id=info["speculative_config"]["mask_token_id"], dtype=engine.dtype)
    if not check.passed:
        raise EngineError(f"{out}: the TensorRT-LLM checkpoint read back fails token forcing ({check.summary()})")
    return {**info, "read_back_token_forcing": check.summary()}


def final_format_weights(engine: Engine) -> dict[str, frozenset[str]]:
    """Per part ("target", "drafter"), the weights the engine stores as u12 planes: an engine directory
    keeps them only so (copy_checkpoint leaves them out of the checkpoint)."""
    return {part: frozenset(packed_weights(model, graph.items()))
            for part, model, graph in (("target", engine.target, engine.program.target),
                                       ("drafter", drafter_root(engine.drafter), engine.program.drafter))}


def save_pass_artifacts(engine: Engine, root: Path, weights: bool = True) -> None:
    """Store what the passes built beside each checkpoint (checksummed safetensors): the u12 planes
    (not for random weights, rebuilt from their seed: `weights` False), the drafter head's token subset."""
    for part, model, graph in (("target", engine.target, engine.program.target),
                               ("drafter", drafter_root(engine.drafter), engine.program.drafter)):
        packed = packed_weights(model, graph.items()) if weights else {}
        if packed:
            save_u12({k: v.to("cpu") for k, v in packed.items()}, root / part / U12_FILE)
    if engine.draft_vocab is not None:
        v = engine.draft_vocab
        (root / "drafter").mkdir(exist_ok=True)
        save_vocab(root / "drafter" / VOCAB_FILE, v.ids, corpus=v.corpus, coverage_share=v.coverage,
                   vocab_size=engine.target_cfg.vocab_size)


def check_serving_fits(spec: PipelineSpec, program: Program, prompts: list[list[int]], target_dir: Path) -> None:
    """SpecError, before anything is built, where a benchmark prompt with its new tokens and one
    verify would outgrow the positions the models hold (the caches are sized to that), or where a
    prompt gives no token or a token the model does not have."""
    lim, q = limits(program), program.step.one("verify")[1]["q"]
    for i, ids in enumerate(prompts):
        if not ids:
            raise SpecError(f"{spec.source}: field 'benchmark.prompts': prompt {i} of {spec.benchmark.prompts!r} "
                            f"gives no tokens")
        if max(ids) >= lim.vocab:
            raise CheckpointError(f"{target_dir / 'tokenizer.json'}: prompt {i} gives token id {max(ids)}; the model's "
                                  f"vocabulary has {lim.vocab}")
    if lim.positions is None:
        return
    room = lim.positions - q - max(len(ids) for ids in prompts)
    if spec.serving.max_new_tokens > room:
        raise SpecError(f"{spec.source}: field 'serving.max_new_tokens': {spec.serving.max_new_tokens} new tokens "
                        f"after the longest prompt ({max(len(ids) for ids in prompts)} tokens) and a verify of {q} do "
                        f"not fit the {lim.positions} positions the models hold (max_position_embeddings): expected "
                        f"at most {max(room, 0)}")


@dataclass
class CompileResult:
    spec: PipelineSpec
    program: Program
    pipeline: str
    records: list[PassRecord]
    measurement: Measurement
    validation: TokenForcingReport
    report: dict
    out_dir: Path | None


def replay_report(engine: Engine, m: Measurement, max_new_tokens: int) -> dict:
    """A replay engine's acceptance against its profile: the profile's τ for this program beside the
    τ the runs measured (runtime/replay.py: Replay.summary), with the profile's source."""
    from .profiles import load_profile

    setup = engine.replay_setup
    profile = load_profile(setup.profile)
    out = engine.replay.summary([(acc, max_new_tokens) for acc in m.spec_accepted])
    draft = engine.program.step.one("draft")[1]
    drafts = draft["block_size"] - 1 if draft["kind"] == "dflash" else draft["block_size"]
    propose = engine.program.step.one("propose")[1]
    budget = propose["budget"] if propose["shape"] == "tree" else None
    out.update(benchmark=setup.benchmark, seed=setup.seed, profile_status=profile.status,
               profile_tau_source=profile.tau_source(drafts, budget),
               published_tau=profile.tau(setup.benchmark), published_at_block=profile.block_size,
               source=f"{profile.source.cite()} ({profile.status})")
    return out


def cost_prediction(program: Program, gpu: str, tau: float, engine: Engine) -> dict:
    """The cost model's ms/token of the AR baseline and of the engine on the spec's GPU, at the
    acceptance the engine runs at: a replay engine's profile, else the τ measured here. Compiles of
    a target by shape report it beside the measured ms/token."""
    from .cost import Workload, explain
    from .cost.gaps import draft_positions

    if engine.replay_setup is not None:
        workload = Workload(acceptance=profile_acceptance(program, engine.replay_setup))
    else:
        workload = Workload(tau=max(1.0, min(tau, draft_positions(program) + 1.0)))
    est = explain(program, gpu, workload)
    return {"gpu": est.gpu, "ar_ms_per_token": round(est.t_ar.value * 1e3, 4),
            "engine_ms_per_token": round(est.t_token.value * 1e3, 4), "speedup_over_ar": round(est.speedup.value, 4),
            "tau": round(est.tau.value, 4), "note": "predicted by the roofline cost model for the spec's GPU "
            "(calibrated by the results files gpus.yaml lists), beside the ms/token measured on this machine"}


def build_report(spec: PipelineSpec, program: Program, pipeline: str, m: Measurement,
                 validation: TokenForcingReport, env: dict, draft_vocab: DraftVocab | None = None,
                 engine: Engine | None = None) -> dict:
    draft = program.step.one("draft")[1]
    drafter = {"kind": draft["kind"], "block_size": draft["block_size"]}
    if draft_vocab is not None:
        drafter["vocab_subset"] = {"size": int(draft_vocab.ids.numel()), "corpus": draft_vocab.corpus,
                                   "corpus_coverage": round(draft_vocab.coverage, 4)}
    report = {
        "name": spec.name,
        "gpu_target": spec.gpu,
        "pipeline": pipeline,
        "ir_hash": program.structural_hash(),
        "drafter": drafter,
        "prompts": len(m.prompts),
        "max_new_tokens": spec.serving.max_new_tokens,
        "tau": round(m.tau, 4),
        "acceptance_histogram": m.acceptance_histogram(draft["block_size"]),
        "ar_ms_per_token": round(m.ar_ms_per_token, 4),
        "engine_ms_per_token": round(m.spec_ms_per_token, 4),
        "speedup_over_ar": round(m.speedup, 4),
        "speedup_note": "measured on this machine; batch 1, prefill excluded; AR = the stock target (no passes) in the "
                        "runtime's static-cache greedy loop: on a GPU the graphed loop over the fused decoder stack",
        "outputs_equal_ar": f"{m.matches_ar}/{len(m.prompts)}",
        "tokens_checked": validation.tokens_checked,
        "token_forcing": validation.summary(),
        "environment": env,
    }
    if spec.target_shape is not None:
        report["target"] = {"shape": spec.target_shape.shape, "weights": spec.target_shape.weights,
                            "seed": spec.target_shape.seed, "tokenizer": "the byte tokenizer of the tiny models "
                            "(ids 0..257: a byte each, then <|endoftext|>, <|mask|>)"}
    if engine is not None and engine.replay is not None:  # a target by shape: what its 8B step would cost
        report["predicted"] = cost_prediction(program, spec.gpu, m.tau, engine)
        report["replay"] = replay_report(engine, m, spec.serving.max_new_tokens)
    return report


def _replay_row(r: dict) -> str:
    if r["measured_tau"] is None:
        return f"{r['profile']}: {r['profile_tau']:.2f} / - (no step began a block before an output's end)"
    return (f"{r['profile']}: {r['profile_tau']:.2f} / {r['measured_tau']:.2f} ({r['measured_over_profile']:.3f}, "
            f"{'within' if r['within_3pct'] else 'outside'} 3%)")


def report_markdown(report: dict) -> str:
    rows = [
        ("pipeline", f"`{report['pipeline'] or '(none)'}`"),
        ("drafter", f"{report['drafter']['kind']}, block {report['drafter']['block_size']}"),
        ("τ (accepted + bonus per step)", f"{report['tau']:.2f}"),
        ("AR ms/token", f"{report['ar_ms_per_token']:.2f}"),
        ("engine ms/token", f"{report['engine_ms_per_token']:.2f}"),
        ("speedup over AR (measured)", f"{report['speedup_over_ar']:.2f}×"),
        *([("predicted on " + report["predicted"]["gpu"] + ": AR / engine ms/token, speedup",
            f"{report['predicted']['ar_ms_per_token']:.2f} / {report['predicted']['engine_ms_per_token']:.2f}, "
            f"{report['predicted']['speedup_over_ar']:.2f}×")] if "predicted" in report else []),
        *([("replay: profile τ / measured τ (ratio)", _replay_row(report["replay"]))] if "replay" in report else []),
        ("outputs equal to AR greedy", report["outputs_equal_ar"]),
        ("token forcing", report["token_forcing"]),
        ("device", report["environment"]["device"]),
    ]
    lines = [f"# Engine report: {report['name']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


@dataclass
class Prepared:
    """Everything a compile decides before it builds anything: every user mistake surfaces here."""

    dirs: ModelDirs
    device: torch.device
    stock: Program
    program: Program
    records: list[PassRecord]
    pipeline: str
    prompts: list[list[int]]


def prepare(spec: PipelineSpec, passes: str | None = None, device: str | None = None) -> Prepared:
    """Models found, configs checked against their weights' headers, lowered, passes checked and run,
    prompts tokenized and checked to fit the positions the models hold; nothing built or written."""
    dirs = resolve_models(spec)
    dev = pick_device(device)
    stock = lower_spec(spec, dirs, default_dtype(dev) if spec.dtype == "auto" else spec.dtype)
    pass_list = resolve_passes(spec, passes)
    program, records = run_passes(stock, pass_list, where=f"{pipeline_source(spec, passes)}: ")
    tokenizer = dirs.tokenizer
    texts = load_prompts(spec.benchmark.prompts, spec.benchmark.num_prompts, source=spec.source,
                         chat=load_chat_template(dirs.target))
    prompts = [tokenizer.encode(t).ids for t in texts]
    check_serving_fits(spec, program, prompts, dirs.target or Path(f"target shape {spec.target}"))
    return Prepared(dirs, dev, stock, program, records, pipeline_string(pass_list), prompts)


def compile_pipeline(spec: PipelineSpec, *, out_dir: Path | None, passes: str | None = None,
                     device: str | None = None, progress=None) -> CompileResult:
    """Compile and validate; write the engine directory only if token forcing passes."""
    with sharing_weights():  # the engine, the AR baseline and the token-forcing reference share the weights
        return _compile_pipeline(spec, out_dir=out_dir, passes=passes, device=device, progress=progress)


def _compile_pipeline(spec: PipelineSpec, *, out_dir: Path | None, passes: str | None, device: str | None,
                      progress) -> CompileResult:
    p = prepare(spec, passes, device)
    dirs, dev, stock, program, records, pipeline, prompts = (p.dirs, p.device, p.stock, p.program, p.records,
                                                             p.pipeline, p.prompts)
    engine = build_engine(program, dirs.target, dirs.drafter, dev, shape=dirs.shape)
    baseline = engine if program.target == stock.target else build_engine(stock, dirs.target, dirs.drafter, dev,
                                                                          shape=dirs.shape)
    m = measure(engine, baseline, prompts, spec.serving.max_new_tokens, progress=progress)
    baseline = None  # its memory goes before token forcing builds the reference (8B shapes: 16 GB each)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    validation = validate_outputs(dirs, engine, m)
    env = environment(dev)
    report = build_report(spec, program, pipeline, m, validation, env, engine.draft_vocab, engine)
    if max(spec.serving.batch_sizes) > 1:  # the batched engine at each concurrency, its outputs forced too
        batches = measure_batches(engine, m.prompts, m.spec_tokens, spec.serving.batch_sizes,
                                  spec.serving.max_new_tokens)
        checked = validate_outputs(dirs, engine, Measurement(prompts=batches.pop("prompts"),
                                                             spec_tokens=batches.pop("outputs")))
        validation.prompts += checked.prompts
        batches["token_forcing"] = checked.summary()
        batches["predicted"] = predicted_batches(program, spec.gpu, spec.serving.batch_sizes, m.tau, batches["rows"])
        report["batches"] = batches
        report["tokens_checked"], report["token_forcing"] = validation.tokens_checked, validation.summary()

    written = None
    if out_dir is not None and validation.passed:
        with atomic_dir(out_dir) as tmp:
            (tmp / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
            (tmp / "pipeline.txt").write_text(pipeline + "\n")
            (tmp / "ir.txt").write_text(print_program(program))
            if dirs.shape is None:
                stored = final_format_weights(engine)
                copy_checkpoint(dirs.target, tmp / "target", stored["target"])
                copy_checkpoint(dirs.drafter, tmp / "drafter", stored["drafter"])
            save_pass_artifacts(engine, tmp, weights=dirs.shape is None)
            write_tuning(tmp, engine.tuning)
            if spec.backend == "trtllm":
                report["trtllm"] = write_trtllm(tmp, dirs, engine, program, prompts, spec)
            write_cost_view(program, spec.gpu, m.tau, report, tmp)
            (tmp / "validation.json").write_text(json.dumps(validation.to_dict(), indent=2) + "\n")
            (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            (tmp / "report.md").write_text(report_markdown(report))
            write_manifest(tmp, {"format": ENGINE_FORMAT, "name": spec.name, "specpilot": __version__,
                                 "versions": versions(), "built_on": {"device": device_name(dev), "gpu": gpu_slug(dev)},
                                 "pipeline": pipeline,
                                 "ir_hash": program.structural_hash(), "dtype": program.attr("dtype"),
                                 "target_source": str(dirs.target or f"shape:{spec.target}"),
                                 "drafter_source": str(dirs.drafter or f"replay:{spec.drafter.profile}"),
                                 "max_new_tokens": spec.serving.max_new_tokens,
                                 "passes": [r.__dict__ for r in records]})
        written = Path(out_dir)
    return CompileResult(spec, program, pipeline, records, m, validation, report, written)


@dataclass
class LoadedEngine:
    root: Path
    manifest: dict
    spec: PipelineSpec
    engine: Engine
    tokenizer: object


def load_engine(root: Path, device: str | None = None) -> LoadedEngine:
    """Open an engine directory (checksums verified; refused if built by another specpilot or for
    another GPU kind) and build its runnable engine from what it stores: no pass runs again."""
    from .backends.engine_dir import read_manifest
    from .ir import parse_program, verify_program
    from .spec import parse_spec

    root = Path(root)
    manifest = read_manifest(root)
    check_compatible(root, manifest, __version__, gpu_slug(pick_device(device)))
    spec = parse_spec(yaml.safe_load((root / "spec.yaml").read_text()), str(root / "spec.yaml"))
    program = parse_program((root / "ir.txt").read_text(), source=str(root / "ir.txt"))
    load_engine_plugins(spec, manifest.get("pipeline", ""), program, str(root / "pipeline.txt"))
    program = verify_program(program)
    tuning = read_tuning(root)  # the kernels run the configs the engine was built with
    if spec.target_shape is not None:  # random weights: rebuilt from the shape and seed, nothing stored but passes'
        shape = shape_models(spec)
        engine = build_engine(program, None, root / "drafter", pick_device(device), shape=shape, tuning=tuning)
        return LoadedEngine(root, manifest, spec, engine, shape.tokenizer())
    engine = build_engine(program, root / "target", root / "drafter", pick_device(device), tuning=tuning)
    return LoadedEngine(root, manifest, spec, engine, load_tokenizer(root / "target"))


def load_engine_plugins(spec: PipelineSpec, pipeline: str, program: Program, source: str) -> None:
    """The plugins an engine was built with, imported again (their weight formats run it): those its
    spec names, those that declare the passes of its pipeline, and those that declare a weight format
    its IR holds that nothing registered."""
    from .ir.node import WEIGHT_FORMATS

    load_plugins(spec)
    for name in pass_names(pipeline, source):
        try:
            lookup(name, f"{source}: ", plugins=True)
        except PipelineError:
            pass  # a rules pass: its rewrites are in the IR already
    for level in ("target", "drafter"):
        for _, node in program.graph(level).items():
            fmt = node.get("format")
            if isinstance(fmt, str) and fmt not in WEIGHT_FORMATS:
                load_weight_format(fmt, f"{source}: ")


def verify_engine(loaded: LoadedEngine, progress=None) -> TokenForcingReport:
    """Re-run the engine on its benchmark prompts and token-force every output token."""
    spec = loaded.spec
    texts = load_prompts(spec.benchmark.prompts, spec.benchmark.num_prompts, source=str(loaded.root / "spec.yaml"),
                         chat=load_chat_template(loaded.root / "target"))
    prompts = [loaded.tokenizer.encode(t).ids for t in texts]
    outputs = []
    for p in prompts:
        outputs.append(loaded.engine.generate(p, spec.serving.max_new_tokens).tokens)
        if progress:
            progress()
    m = Measurement(prompts=prompts, spec_tokens=outputs)
    if spec.target_shape is not None:
        return validate_outputs(ModelDirs(None, None, shape_models(spec)), loaded.engine, m)
    source = Path(loaded.manifest.get("target_source", ""))
    ref_dir = source if (source / "config.json").is_file() else loaded.root / "target"
    return validate_outputs(ModelDirs(ref_dir, loaded.root / "drafter"), loaded.engine, m)


def explained_program(spec: PipelineSpec, passes: str | None = None, *, on_cpu: bool = False) -> Program:
    """The program `explain` prices: the spec's deployment lowered (unless the spec says: bf16, or
    fp32 on a CPU, as the runtime runs there) and its passes run, each verified."""
    auto = "float32" if on_cpu else "bfloat16"
    program = lower_spec(spec, resolve_models(spec), auto if spec.dtype == "auto" else spec.dtype)
    return run_passes(program, resolve_passes(spec, passes), where=f"{pipeline_source(spec, passes)}: ")[0]


def explain_pipeline(spec: PipelineSpec, *, passes: str | None = None, tau: float | None = None,
                     results=None, on_cpu: bool = False):
    """The cost model's estimate for the spec's deployment on its GPU (bf16 unless the spec says),
    calibrated by `results` (files or folders), by default by the files gpus.yaml lists for the GPU;
    `on_cpu`: on this host's CPU instead (cost/cpu.py's device, its figures measured here once and
    cached, as `tune --device cpu` prices its trials)."""
    from .cost import Workload, explain

    program = explained_program(spec, passes, on_cpu=on_cpu)
    device = spec.gpu
    if on_cpu:
        from .cost.cpu import cpu_device

        device = cpu_device(program)
    workload = Workload(tau=tau)
    if tau is None and spec.target_shape is not None:  # a replay drafter: the acceptance its profile publishes
        workload = Workload(acceptance=profile_acceptance(program, shape_models(spec).replay))
    return explain(program, device, workload, results=None if results is None else [str(r) for r in results],
                   what_ifs=what_ifs)


def profile_acceptance(program: Program, replay: ReplaySetup):
    """The cost model's acceptance of a replay drafter: its profile's per-position alpha over the
    program's draft positions (the model the profile file states)."""
    from .cost import AcceptanceModel
    from .cost.gaps import draft_positions
    from .profiles import load_profile

    alpha = load_profile(replay.profile).alpha(replay.benchmark)
    return AcceptanceModel.geometric(alpha, draft_positions(program), "predicted",
                                     f"profile {replay.profile}/{replay.benchmark}: alpha={alpha:.4f}")


# --- trials: what the search agent's workers run (the agent is handed these; it sits below us)


def _trial_engines(job, baseline: Engine | None = None):
    """A trial's spec prepared with the job's pipeline (its rules texts loaded first: data, parsed
    by the DSL) and its engine and baseline built on the job's device (`baseline`: one built for an
    earlier job of the same spec, shared)."""
    for source, text in job.rules:
        load_rules(text, source=source)
    p = prepare(job.spec, job.pipeline, job.device)
    engine = build_engine(p.program, p.dirs.target, p.dirs.drafter, p.device, shape=p.dirs.shape)
    refuse_written_weights()  # blamed on the build that wrote, before another candidate reads them
    if p.program.target == p.stock.target:
        baseline = engine
    elif baseline is None:
        baseline = build_engine(p.stock, p.dirs.target, p.dirs.drafter, p.device, shape=p.dirs.shape)
    return p, engine, baseline


def _trial_result(job, p: Prepared, engine: Engine, m: Measurement, t0: float):
    from .agent.trial import REJECTED, VALIDATED, TrialResult

    validation = validate_outputs(p.dirs, engine, m)
    passed, reason, extra = validation.passed, "" if validation.passed else "token forcing: " + validation.summary(), {}
    if passed and job.strict_referee and engine.dtype == "bfloat16":
        verdict = strict_validation(p.dirs, engine, m)
        passed, reason = verdict.passed, verdict.reason
        extra["strict_referee"] = verdict.summary()
    return TrialResult(job.trial, job.pipeline, VALIDATED if passed else REJECTED, reason=reason,
                       ar_ms=m.ar_ms_per_token, engine_ms=m.spec_ms_per_token, tau=m.tau,
                       tokens_checked=validation.tokens_checked, hard_failures=validation.hard_failures,
                       near_ties=validation.near_ties, forcing=validation.summary(),
                       ir_hash=p.program.structural_hash(), device=str(p.device), wall_s=time.perf_counter() - t0,
                       extra={"outputs_equal_ar": m.matches_ar, "prompts": len(m.prompts), **extra})


def strict_validation(dirs: ModelDirs, engine: Engine, m: Measurement):
    """A bf16 engine judged by the strict referee (validate/referee.py): against the target in fp32,
    near-ties within the bf16 noise measured on these prompts, no more than the stock AR loop's."""
    from .validate.referee import strict_referee

    def reference(dtype):
        if dirs.shape is not None:
            return dirs.shape.target(dtype, engine.device)[0]
        return load_target(dirs.target, dtype=dtype, device=engine.device)[0]

    with private_weights():  # the fp32 copy is this check's alone: gone when it returns, never kept for later trials
        fp32 = reference(torch.float32)
    return strict_referee(fp32, reference(torch.bfloat16), m.prompts, m.spec_tokens, m.ar_tokens)


def measure_trial(job, p: Prepared, engine: Engine, baseline: Engine) -> Measurement:
    """What a trial times: a deployment served one request at a time, the batch-1 loops beside the
    stock AR loop (`measure`); one served at batch (serving.batch_sizes above 1), the batched engine
    against the stock target's batched AR at its largest batch (`measure_served`)."""
    batch = max(job.spec.serving.batch_sizes)
    if batch <= 1:
        return measure(engine, baseline, p.prompts, job.spec.serving.max_new_tokens)
    return measure_served(engine, baseline, p.prompts, batch, job.spec.serving.max_new_tokens)


def free_memory(device: torch.device | str) -> None:
    """Free what finished trials left: their engines sit in reference cycles (a fused stack and the
    graphed runners point back at their model), which only the collector breaks; then the CUDA
    allocator's cached blocks go back, so the next trial (or another process) gets them."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _peak_memory_start(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory_gib(device: torch.device) -> float | None:
    """The device memory the allocator held at most since `_peak_memory_start` (GiB); None on a CPU."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def run_trial(job):
    """One candidate of a search: built, measured beside the AR baseline on the spec's prompts,
    token-forced. Never raises for the candidate's own faults: they come back as a FAILED trial.
    Everything it built is freed before it returns (free_memory); the target's own weights stay
    where a `sharing_weights` scope holds them. The result carries the trial's peak device memory."""
    device = pick_device(job.device)
    free_memory(device)
    _peak_memory_start(device)
    try:
        result = _run_trial(job)
    finally:
        free_memory(device)
    result.peak_memory_gib = _peak_memory_gib(device)
    return result


def _run_trial(job):
    t0 = time.perf_counter()
    try:
        with sharing_weights():  # the engine, the AR baseline and the token-forcing reference share weights
            p, engine, baseline = _trial_engines(job)
            m = measure_trial(job, p, engine, baseline)
            baseline = None
            return _trial_result(job, p, engine, m, t0)
    except Exception as e:  # a candidate that does not build or run here fails its trial, not the search
        return _trial_fault(job, e)


def _trial_fault(job, e: Exception):
    """A trial that raised: rejected where its engine wrote into the weights token forcing's reference
    shares (as an engine that fails token forcing is), else failed (it does not build or run here)."""
    from .agent.trial import REJECTED, TrialResult

    if isinstance(e, WeightsWrittenError):
        return TrialResult(job.trial, job.pipeline, REJECTED, reason=str(e), device=job.device)
    return TrialResult.failed(job, f"{type(e).__name__}: {str(e)[:500]}")


def run_trials_interleaved(jobs, rounds: int = 3):
    """A round's candidates on one device in one process: each built, then all timed round-robin
    (every round runs each engine over every prompt, the engines in an order rotated by one each
    round), the AR baseline among them, so a drift of the card's clocks lands on all alike; then
    each token-forced. A candidate that does not build fails alone. The engines share the target's
    unchanged weights (`sharing_weights`) and are freed before it returns; each result carries the
    round's peak device memory (all its engines were alive at once)."""
    devices = {pick_device(j.device) for j in jobs} or {torch.device("cpu")}
    for device in devices:
        free_memory(device)
        _peak_memory_start(device)
    try:
        with sharing_weights():
            results = _run_trials_interleaved(jobs, rounds)
    finally:
        for device in devices:
            free_memory(device)
    for r, job in zip(results, jobs):
        r.peak_memory_gib = _peak_memory_gib(pick_device(job.device))
    return results


def _run_trials_interleaved(jobs, rounds: int):
    t0 = time.perf_counter()
    built, failed, stock = {}, {}, {}
    for job in jobs:
        try:
            built[job.trial] = (job, *_trial_engines(job, stock.get(job.spec)))
            p, engine, baseline = built[job.trial][1:]
            if baseline is not engine:
                stock[job.spec] = baseline  # the stock target's AR loop, shared by the round's candidates
        except Exception as e:
            failed[job.trial] = _trial_fault(job, e)
    ms = {t: Measurement(prompts=b[1].prompts) for t, b in built.items()}
    ar = {t: 0.0 for t in built}
    # engine/AR of each (round, prompt) at batch 1, of each round when served at batch: paired samples
    # for the search's confidence rule (the same prompts in the same order for every trial of a round)
    per_round: dict[int, list[float]] = {t: [] for t in built}
    order = list(built)
    for r in range(rounds):
        for t in order[r % len(order):] + order[:r % len(order)] if order else []:
            job, p, engine, baseline = built[t]
            try:
                one = measure_trial(job, p, engine, baseline)
            except Exception as e:
                failed[t] = _trial_fault(job, e)
                continue
            m = ms[t]
            if r == 0:
                m.prompts, m.ar_tokens, m.spec_tokens, m.accepted, m.spec_accepted, m.served_tau = (
                    one.prompts, one.ar_tokens, one.spec_tokens, one.accepted, one.spec_accepted, one.served_tau)
            m.spec_decode_s += one.spec_decode_s / rounds
            ar[t] += one.ar_decode_s / rounds
            samples = one.prompt_ratios()
            if not samples and one.ar_ms_per_token > 0:
                samples = [one.spec_ms_per_token / one.ar_ms_per_token]
            per_round[t].extend(samples)
    out = []
    for job in jobs:
        if job.trial in failed:
            out.append(failed[job.trial])
            continue
        _, p, engine, _ = built[job.trial]
        m = ms[job.trial]
        m.ar_decode_s = ar[job.trial]
        try:
            r = _trial_result(job, p, engine, m, t0)
            r.extra["rounds_relative"] = per_round[job.trial]
            out.append(r)
        except Exception as e:
            out.append(_trial_fault(job, e))
    return out


def cost_device(spec: PipelineSpec, device: torch.device, stock: Program, *, cache: Path | None = None):
    """What a search's cost model prices: where trials run on a CPU, this host's CPU (cost/cpu.py:
    its figures measured here, cached per host under `cache`, by default the specpilot cache);
    elsewhere the spec's GPU."""
    if device.type == "cpu":
        from .cost.cpu import cpu_device

        return cpu_device(stock, root=cache)
    return spec.gpu


def tune_setup(spec: PipelineSpec, device: str | None = None, *, cache: Path | None = None):
    """The deployment a search tunes (agent.search.Setup): its stock program on `device`, starting
    pipeline, fingerprint and predictor, which prices on `cost_device` (on a CPU: this host's record,
    read from `cache` or measured there)."""
    from .agent.fingerprint import fingerprint
    from .agent.predict import Predictor
    from .agent.search import Setup
    from .bench.harness import gpu_slug

    dirs, dev = resolve_models(spec), pick_device(device)
    stock = lower_spec(spec, dirs, default_dtype(dev) if spec.dtype == "auto" else spec.dtype)
    start = pipeline_string(resolve_passes(spec, None))
    predictor = Predictor(cost_device(spec, dev, stock, cache=cache), what_ifs)
    return Setup(spec, stock, start, fingerprint(stock, gpu_slug(dev), spec.serving.batch_sizes), dev.type,
                 predictor.model.gpu.name, predictor)


@dataclass
class TuneResult:
    search: object  # agent.search.SearchResult
    engine: CompileResult | None
    report: Path
    out_dir: Path


def tune_pipeline(spec: PipelineSpec, *, out_dir: Path, config=None, workers: str = "1", memory: Path | None = None,
                  device: str | None = None, progress=None, log=None, interleave: bool = True) -> TuneResult:
    """Search pass pipelines for the spec's deployment (specpilot.agent), then compile the best
    validated one into out_dir/engine and write the search report (out_dir/report.html,
    search.json). Ctrl-C stops the search with the best validated pipeline so far."""
    from .agent.memory import Memory
    from .agent.report import write_report
    from .agent.search import Search, TuneConfig
    from .agent.workers import WorkersSpec, make_pool
    from .bench.harness import git_commit

    config = config or TuneConfig(commit=git_commit())
    setup = tune_setup(spec, device)
    dev = pick_device(device)
    store = Memory(memory) if memory is not None else None
    # interleave False: one GPU runs a round's candidates one after another (8B engines do not fit together)
    interleaved = functools.partial(run_trials_interleaved, rounds=config.repeats) if interleave else None
    pool = make_pool(WorkersSpec.parse(workers), run_trial, interleaved, dev.type)
    # one set of the deployment's weights for every trial in this process, and the final compile
    with sharing_weights():
        try:
            result = Search(setup, pool, store, config, log).run(progress)
        finally:
            pool.close()
            if store is not None:
                store.close()
        out_dir = Path(out_dir)
        engine = compile_pipeline(spec, out_dir=out_dir / "engine", passes=result.best, device=device)
    free_memory(dev)
    page = write_report(out_dir, result, spec.name, engine.report)
    return TuneResult(result, engine, page, out_dir)
