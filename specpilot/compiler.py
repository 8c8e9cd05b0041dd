"""The compile driver: spec -> IR -> passes -> engine -> token forcing -> engine directory.

    spec = load_spec("pipeline.yaml")
    result = compile_pipeline(spec, out_dir=Path("engines/demo"))

Each stage is the owner room's code; this module only strings them together and measures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from . import __version__
from .backends.engine_dir import atomic_dir, copy_checkpoint, write_manifest
from .backends.torch_backend import (U12_FILE, Engine, build_engine, default_dtype, drafter_root, packed_weights,
                                     pick_device)
from .bench.harness import Measurement, environment, measure
from .bench.prompts import load_prompts
from .dsl import load_rules, parse_pipeline
from .errors import CheckpointError
from .ir import Program, lower, print_program
from .passes import PassRecord, pipeline_string, run_passes
from .passes.what_if import what_ifs
from .passes.base import Pass
from .runtime.builtin import is_builtin, resolve_builtin
from .runtime.draft_vocab import VOCAB_FILE, DraftVocab, save_vocab
from .runtime.load import load_target
from .runtime.tokenizer import load_tokenizer
from .formats.u12 import save_u12
from .spec import PipelineSpec
from .validate.forcing import TokenForcingReport, force_tokens


@dataclass(frozen=True)
class ModelDirs:
    target: Path
    drafter: Path


def resolve_models(spec: PipelineSpec) -> ModelDirs:
    target = resolve_builtin(spec.target) if is_builtin(spec.target) else Path(spec.target)
    if spec.drafter.path:
        d = spec.drafter.path
        drafter = resolve_builtin(d) if is_builtin(d) else Path(d)
    elif is_builtin(spec.target):
        drafter = resolve_builtin(f"{spec.target}/{spec.drafter.kind}")
    else:
        raise CheckpointError(f"{spec.source}: missing field 'drafter.path' (a local drafter directory)")
    for what, path in (("target", target), ("drafter.path", drafter)):
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{spec.source}: field '{what}': {path} is not a model directory (no config.json)")
    return ModelDirs(target, drafter)


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: not valid JSON ({e.msg})") from None


def lower_spec(spec: PipelineSpec, dirs: ModelDirs, dtype: str) -> Program:
    program = lower(
        _read_config(dirs.target), _read_config(dirs.drafter), dtype=dtype, block_size=spec.drafter.block_size,
        target_source=str(dirs.target / "config.json"), drafter_source=str(dirs.drafter / "config.json"),
    )
    kind = program.step.one("draft")[1]["kind"]
    if kind != spec.drafter.kind:
        raise CheckpointError(f"{spec.source}: field 'drafter.kind' is {spec.drafter.kind!r} but "
                              f"{dirs.drafter / 'config.json'} describes a {kind} drafter")
    return program


def resolve_passes(spec: PipelineSpec, override: str | None) -> list[Pass]:
    for rules in spec.rules:
        load_rules(Path(rules), source=rules)
    text = spec.passes if override is None else override
    source = "--passes" if override is not None else f"{spec.source}: field 'passes'"
    return parse_pipeline(text, source=source)


def validate_outputs(dirs: ModelDirs, engine: Engine, m: Measurement) -> TokenForcingReport:
    """Token forcing against the unmodified target checkpoint, on every output token."""
    from .backends.torch_backend import TORCH_DTYPES

    reference, ref_cfg = load_target(dirs.target, dtype=TORCH_DTYPES[engine.dtype], device=engine.device)
    return force_tokens(reference, ref_cfg, m.prompts, m.spec_tokens, engine.dtype)


def write_cost_view(program: Program, gpu: str, tau: float, report: dict, root: Path) -> None:
    """The cost model's view of the engine on its target GPU (τ as measured here): into the
    report, and as a roofline/gap chart beside it."""
    from .cost import Workload, explain, plot_gaps

    estimate = explain(program, gpu, Workload(tau=tau), what_ifs=what_ifs)
    report["cost_model"] = estimate.to_dict()
    plot_gaps(estimate, root / "explain.png")


def save_pass_artifacts(engine: Engine, root: Path) -> None:
    """Store what the passes built beside each checkpoint (checksummed safetensors): the u12 planes,
    the drafter head's token subset."""
    for part, model, graph in (("target", engine.target, engine.program.target),
                               ("drafter", drafter_root(engine.drafter), engine.program.drafter)):
        packed = packed_weights(model, graph.items())
        if packed:
            save_u12({k: v.to("cpu") for k, v in packed.items()}, root / part / U12_FILE)
    if engine.draft_vocab is not None:
        v = engine.draft_vocab
        save_vocab(root / "drafter" / VOCAB_FILE, v.ids, corpus=v.corpus, coverage_share=v.coverage,
                   vocab_size=engine.target_cfg.vocab_size)


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


def build_report(spec: PipelineSpec, program: Program, pipeline: str, m: Measurement,
                 validation: TokenForcingReport, env: dict, draft_vocab: DraftVocab | None = None) -> dict:
    draft = program.step.one("draft")[1]
    drafter = {"kind": draft["kind"], "block_size": draft["block_size"]}
    if draft_vocab is not None:
        drafter["vocab_subset"] = {"size": int(draft_vocab.ids.numel()), "corpus": draft_vocab.corpus,
                                   "corpus_coverage": round(draft_vocab.coverage, 4)}
    return {
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
        "speedup_note": "measured on this machine; prefill excluded; AR = the stock target (no passes) in the runtime's static-cache greedy loop",
        "outputs_equal_ar": f"{m.matches_ar}/{len(m.prompts)}",
        "tokens_checked": validation.tokens_checked,
        "token_forcing": validation.summary(),
        "environment": env,
    }


def report_markdown(report: dict) -> str:
    rows = [
        ("pipeline", f"`{report['pipeline'] or '(none)'}`"),
        ("drafter", f"{report['drafter']['kind']}, block {report['drafter']['block_size']}"),
        ("τ (accepted + bonus per step)", f"{report['tau']:.2f}"),
        ("AR ms/token", f"{report['ar_ms_per_token']:.2f}"),
        ("engine ms/token", f"{report['engine_ms_per_token']:.2f}"),
        ("speedup over AR (measured)", f"{report['speedup_over_ar']:.2f}×"),
        ("outputs equal to AR greedy", report["outputs_equal_ar"]),
        ("token forcing", report["token_forcing"]),
        ("device", report["environment"]["device"]),
    ]
    lines = [f"# Engine report: {report['name']}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


def compile_pipeline(spec: PipelineSpec, *, out_dir: Path | None, passes: str | None = None,
                     device: str | None = None, progress=None) -> CompileResult:
    """Compile and validate; write the engine directory only if token forcing passes."""
    dirs = resolve_models(spec)
    dev = pick_device(device)
    stock = lower_spec(spec, dirs, default_dtype(dev) if spec.dtype == "auto" else spec.dtype)
    pass_list = resolve_passes(spec, passes)
    program, records = run_passes(stock, pass_list)
    pipeline = pipeline_string(pass_list)

    engine = build_engine(program, dirs.target, dirs.drafter, dev)
    baseline = engine if program.target == stock.target else build_engine(stock, dirs.target, dirs.drafter, dev)
    tokenizer = load_tokenizer(dirs.target)
    texts = load_prompts(spec.benchmark.prompts, spec.benchmark.num_prompts, source=spec.source)
    prompts = [tokenizer.encode(t).ids for t in texts]
    m = measure(engine, baseline, prompts, spec.serving.max_new_tokens, progress=progress)
    validation = validate_outputs(dirs, engine, m)
    env = environment(dev)
    report = build_report(spec, program, pipeline, m, validation, env, engine.draft_vocab)

    written = None
    if out_dir is not None and validation.passed:
        with atomic_dir(out_dir) as tmp:
            (tmp / "spec.yaml").write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
            (tmp / "pipeline.txt").write_text(pipeline + "\n")
            (tmp / "ir.txt").write_text(print_program(program))
            copy_checkpoint(dirs.target, tmp / "target")
            copy_checkpoint(dirs.drafter, tmp / "drafter")
            save_pass_artifacts(engine, tmp)
            write_cost_view(program, spec.gpu, m.tau, report, tmp)
            (tmp / "validation.json").write_text(json.dumps(validation.to_dict(), indent=2) + "\n")
            (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            (tmp / "report.md").write_text(report_markdown(report))
            write_manifest(tmp, {"name": spec.name, "specpilot": __version__, "pipeline": pipeline,
                                 "ir_hash": program.structural_hash(), "dtype": program.attr("dtype"),
                                 "target_source": str(dirs.target), "drafter_source": str(dirs.drafter),
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
    """Open an engine directory (checksums verified) and build its runnable engine."""
    from .backends.engine_dir import read_manifest
    from .ir import parse_program, verify_program
    from .spec import parse_spec

    root = Path(root)
    manifest = read_manifest(root)
    program = verify_program(parse_program((root / "ir.txt").read_text(), source=str(root / "ir.txt")))
    spec = parse_spec(yaml.safe_load((root / "spec.yaml").read_text()), str(root / "spec.yaml"))
    engine = build_engine(program, root / "target", root / "drafter", pick_device(device))
    return LoadedEngine(root, manifest, spec, engine, load_tokenizer(root / "target"))


def verify_engine(loaded: LoadedEngine, progress=None) -> TokenForcingReport:
    """Re-run the engine on its benchmark prompts and token-force every output token."""
    spec = loaded.spec
    texts = load_prompts(spec.benchmark.prompts, spec.benchmark.num_prompts, source=str(loaded.root / "spec.yaml"))
    prompts = [loaded.tokenizer.encode(t).ids for t in texts]
    outputs = []
    for p in prompts:
        outputs.append(loaded.engine.generate(p, spec.serving.max_new_tokens).tokens)
        if progress:
            progress()
    source = Path(loaded.manifest.get("target_source", ""))
    ref_dir = source if (source / "config.json").is_file() else loaded.root / "target"
    m = Measurement(prompts=prompts, spec_tokens=outputs)
    return validate_outputs(ModelDirs(ref_dir, loaded.root / "drafter"), loaded.engine, m)


def explain_pipeline(spec: PipelineSpec, *, passes: str | None = None, tau: float | None = None,
                     results=()):
    """The cost model's estimate for the spec's deployment on its GPU (bf16 unless the spec says)."""
    from .cost import Workload, explain

    dirs = resolve_models(spec)
    program = lower_spec(spec, dirs, "bfloat16" if spec.dtype == "auto" else spec.dtype)
    program, _ = run_passes(program, resolve_passes(spec, passes))
    return explain(program, spec.gpu, Workload(tau=tau), results=[str(r) for r in results], what_ifs=what_ifs)
