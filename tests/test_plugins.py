"""Python passes as plugins (specpilot/passes/plugins.py): installed packages' entry points and local
modules, what they get that built-ins get, what a broken one does, and the worked example of
docs/WRITING-PASSES.md (examples/specpilot-verify-width) installed with pip and driven through the CLI.

Most tests install a distribution the way importlib.metadata finds one (a NAME-VERSION.dist-info
folder with METADATA and entry_points.txt, its modules beside it, on sys.path): no pip, no network.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specpilot.backends import torch_backend
from specpilot.cli import main
from specpilot.compiler import lower_spec, resolve_models
from specpilot.cost.roofline import matmul_weight_bytes
from specpilot.dsl import parse_pipeline
from specpilot.errors import PipelineError, PluginError
from specpilot.ir import node as ir_node
from specpilot.ir import parse_program
from specpilot.kernels.registry import KERNELS, KernelSpec, check_kernel
from specpilot.passes import REGISTRY
from specpilot.passes.plugins import Origin, load_kernel, load_weight_format, origin_of, unload
from specpilot.passes.what_if import to_measure, what_ifs
from specpilot.spec import load_spec

from conftest import tiny_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "specpilot-verify-width"
WIDTH_MODULE = (EXAMPLE / "specpilot_verify_width.py").read_text()


@pytest.fixture(autouse=True)
def model_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path_factory.getbasetemp() / "specpilot-cache"))


class Site:
    """A folder on sys.path where `install` puts distributions as importlib.metadata finds them."""

    def __init__(self, root: Path):
        self.root, self.modules, self.origins = root, [], []
        root.mkdir()

    def install(self, dist: str, entry_points: dict[str, dict[str, str]], modules: dict[str, str]) -> Origin:
        info = self.root / f"{dist.replace('-', '_')}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("".join(
            f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in names.items())
            for group, names in entry_points.items()))
        for module, text in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(text))
        self.modules += list(modules)
        importlib.invalidate_caches()
        origin = Origin("plugin", f"{dist} 0.1")
        self.origins.append(origin)
        return origin


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Plugins installed by a test, and all they registered, are gone after it."""
    saved = (dict(REGISTRY), set(ir_node.WEIGHT_FORMATS), dict(ir_node.FORMAT_BITS),
             dict(torch_backend.WEIGHT_FORMATS), dict(KERNELS))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    s = Site(tmp_path / "site")
    yield s
    for cls in list(REGISTRY.values()):
        unload(origin_of(cls))
    for origin in s.origins:
        unload(origin)
    for module in s.modules:
        sys.modules.pop(module, None)
    REGISTRY.clear()
    REGISTRY.update(saved[0])
    ir_node.WEIGHT_FORMATS.clear()
    ir_node.WEIGHT_FORMATS.update(saved[1])
    for live, kept in ((ir_node.FORMAT_BITS, saved[2]), (torch_backend.WEIGHT_FORMATS, saved[3]), (KERNELS, saved[4])):
        live.clear()
        live.update(kept)
    importlib.invalidate_caches()


def install_width(site: Site) -> Origin:
    """The worked example, installed as pip would (its module, its entry point)."""
    return site.install("specpilot-verify-width",
                        {"specpilot.passes": {"verify-width": "specpilot_verify_width:VerifyWidth"}},
                        {"specpilot_verify_width": WIDTH_MODULE})


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def write_spec(tmp_path: Path, extra: str = "", kind: str = "pard") -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(tiny_spec(kind, extra=extra))
    return path


def table_rows(output: str) -> dict[str, list[str]]:
    """A rich table's rows by their first cell: each row's other cells joined over its wrapped lines,
    spaces dropped (a folded cell breaks anywhere)."""
    rows: dict[str, list[str]] = {}
    name = None
    for line in output.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) < 2:
            continue
        if cells[0]:
            name = cells[0]
            rows[name] = [""] * (len(cells) - 1)
        if name is not None:
            rows[name] = [a + b.replace(" ", "") for a, b in zip(rows[name], cells[1:])]
    return rows


def squeezed(text: str) -> str:
    return text.replace(" ", "")


def assert_user_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    for f in fragments:
        assert f in result.output, result.output


# ----------------------------------------------------------------------------- finding and trusting plugins


def test_an_installed_pass_is_imported_only_when_a_users_pipeline_names_it(site):
    origin = install_width(site)
    assert "verify-width" not in REGISTRY
    # a pipeline from elsewhere (the agent's proposer) never imports a plugin
    with pytest.raises(PipelineError, match="unknown pass 'verify-width'"):
        parse_pipeline("verify-width{q=8}")
    assert "specpilot_verify_width" not in sys.modules
    # the user's own pipeline does
    [p] = parse_pipeline("verify-width{q=8}", plugins=True)
    assert p.spec() == "verify-width{q=8}" and origin_of(type(p)) == origin
    assert origin_of(REGISTRY["draft-block-size"]) == Origin("built-in")


def test_passes_lists_where_each_pass_came_from(site, tmp_path):
    install_width(site)
    (tmp_path / "mine.rules").write_text('pass head-bf16 (lossy) {\n  rule r: match lm_head set format = "bfloat16"\n}\n')
    local = tmp_path / "local_pass.py"
    local.write_text(WIDTH_MODULE.replace('"verify-width"', '"local-width"'))
    spec = write_spec(tmp_path, f"rules: [mine.rules]\nplugins: [{local.name}]\npasses: \"head-bf16,local-width{{q=3}}\"")
    assert invoke("explain", spec, "--tau", "2").exit_code == 0  # loads the rules file and the local module
    r = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["passes"])
    assert r.exit_code == 0, r.output
    rows = table_rows(r.output)  # from, parameters, contract, search, what it does
    assert rows["draft-block-size"][0] == "built-in"
    assert rows["verify-width"][0] == squeezed("plugin specpilot-verify-width 0.1")
    assert rows["verify-width"][3] == squeezed("predicted: closes verify width off the optimum")
    assert rows["local-width"][0] == squeezed(f"module {local.resolve()}")
    assert rows["head-bf16"][0] == squeezed(f"rules {(tmp_path / 'mine.rules').resolve()}")
    assert rows["head-bf16"][2:4] == ["lossy", squeezed("never (lossy)")]


def test_the_spec_names_local_modules_and_installed_plugins(site, tmp_path):
    install_width(site)
    local = tmp_path / "width.py"
    local.write_text(WIDTH_MODULE.replace('"verify-width"', '"local-width"'))
    spec = load_spec(write_spec(tmp_path, "plugins: [width.py, specpilot-verify-width]"))
    assert spec.plugins == (str(local.resolve()), "specpilot-verify-width")
    # a distribution named in `plugins:` is loaded whole: a search is offered its passes unnamed
    r = invoke("explain", write_spec(tmp_path, "plugins: [width.py, specpilot-verify-width]"), "--tau", "2")
    assert r.exit_code == 0, r.output
    assert "verify-width" in REGISTRY and "local-width" in REGISTRY
    for extra, fragments in [
        ("plugins: [nowhere.py]", ["field 'plugins': no such file", "nowhere.py"]),
        ("plugins: [no-such-plugin]", ["field 'plugins': no installed plugin 'no-such-plugin'",
                                       "installed plugins: specpilot-verify-width"]),
        ("plugins: [1]", ["field 'plugins'", "local module files (.py) or installed plugin names"]),
    ]:
        assert_user_error(invoke("compile", write_spec(tmp_path, extra), "-o", tmp_path / "e"), *fragments)
    assert not (tmp_path / "e").exists()


def test_the_guides_rule_pass_moves_only_the_targets_attention(site, tmp_path):
    """docs/WRITING-PASSES.md's first pass (examples/rules/target_split_kv.rules), seen through `explain --ir`."""
    rules = ROOT / "examples" / "rules" / "target_split_kv.rules"
    spec = write_spec(tmp_path, f'rules: [{rules}]\npasses: "target-split-kv"', kind="dflash")
    r = invoke("explain", spec, "--ir")
    assert r.exit_code == 0, r.output
    program = parse_program(r.output)
    assert {node["kernel"] for _, node in program.target.items() if node.op == "attention"} == {"triton-split-kv"}
    assert {node["kernel"] for _, node in program.drafter.items() if node.op == "attention"} == {"sdpa"}


# ----------------------------------------------------------------------------- what a plugin pass gets


@pytest.mark.parametrize("passes, fragments", [
    ("verify-width{q=1}", ["--passes:1:1: pass 'verify-width': q must be >= 2 (the anchor and at least one "
                           "candidate), got 1"]),
    ("verify-width{q=\"wide\"}", ["pass 'verify-width': parameter 'q' expects int, got \"wide\""]),
    ("verify-width{width=8}", ["pass 'verify-width' has no parameter 'width' (parameters: q)"]),
    ("verify-width{q=100000}", ["--passes: pass 'verify-width': parameter 'q' = 100000 is out of range for this "
                                "deployment: expected 2..", "max_position_embeddings"]),
])
def test_a_plugin_pass_parameters_are_checked_like_a_built_ins(site, tmp_path, passes, fragments):
    install_width(site)
    r = invoke("compile", write_spec(tmp_path), "--passes", passes, "-o", tmp_path / "e")
    assert_user_error(r, *fragments)
    assert not (tmp_path / "e").exists()


def test_a_plugin_schedule_space_is_offered_to_searches_as_what_ifs(site, tmp_path):
    install_width(site)
    site.install("measured-only", {"specpilot.passes": {"no-gap": "measured_only:NoGap"}}, {"measured_only": """
        from dataclasses import dataclass
        from specpilot.passes import Pass, PassResult, register

        @register
        @dataclass(frozen=True)
        class NoGap(Pass):
            name = "no-gap"  # lossless, declares no `closes`: the cost model cannot predict it
            size: int = 3

            def apply(self, program):
                return PassResult(program, False)

            @classmethod
            def schedule_space(cls, program):
                return [cls(size=2), cls(size=5)]
        """})
    spec = load_spec(write_spec(tmp_path, kind="dflash"))
    program = lower_spec(spec, resolve_models(spec), "float32")
    parse_pipeline("verify-width,no-gap", plugins=True)
    offered = {w.pipeline: w for w in what_ifs(program) if w.pass_name == "verify-width"}
    # q = 4 now; every width the schedule space names but that one, each within the positions the models hold
    assert set(offered) == {f"verify-width{{q={q}}}" for q in (2, 8, 12, 16, 24, 32)}
    wide = offered["verify-width{q=16}"].program
    assert wide.step.one("verify")[1]["q"] == 16 and wide.step.one("draft")[1]["block_size"] == 16
    # on a chain, a width is a block size: the cost model prices the plugin's program as the built-in's
    block = next(w for w in what_ifs(program, ("draft-block-size",)) if w.pipeline == "draft-block-size{size=16}")
    assert wide == block.program
    assert [p.spec() for p in to_measure(program, ("no-gap",))] == ["no-gap{size=2}", "no-gap{size=5}"]
    assert not any(w.pass_name == "no-gap" for w in what_ifs(program))


def test_a_plugin_weight_format_runs_is_token_forced_and_reloads_with_its_engine(site, tmp_path):
    """A plugin's pass moves the target's head to the plugin's weight format (registered without
    bits per weight: the cost model says it cannot predict it); the compile is token-forced as any
    other, and the engine loads again in a process that has imported nothing of the plugin."""
    origin = site.install("head-copy", {"specpilot.passes": {"head-copy": "head_copy:HeadCopy"},
                                        "specpilot.weight_formats": {"copy": "head_copy"}}, {"head_copy": """
        from dataclasses import dataclass
        import torch
        from specpilot.backends.torch_backend import register_weight_format
        from specpilot.passes import Pass, PassResult, register

        def build(node, weight, compute):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=compute, device=weight.device)
            linear.weight.data.copy_(weight)
            return linear

        register_weight_format("copy", build)

        @register
        @dataclass(frozen=True)
        class HeadCopy(Pass):
            name = "head-copy"

            def apply(self, program):
                name, node = program.target.one("lm_head")
                g = program.target.with_node(name, node.replace(format="copy"))
                return PassResult(program.with_graph("target", g), True)
        """})
    out = tmp_path / "e"
    spec = write_spec(tmp_path, 'passes: "head-copy"')
    r = invoke("compile", spec, "-o", out, "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "validation.json").read_text())["passed"]
    report = json.loads((out / "report.json").read_text())
    assert "cannot price weight format 'copy'" in report["cost_model"]["not_predicted"]
    assert_user_error(invoke("explain", spec, "--tau", "2"), "cannot price weight format 'copy'",
                      "measured (specpilot compile) but not predicted")
    # as in a fresh process: nothing of the plugin registered or imported
    unload(origin)
    ir_node.WEIGHT_FORMATS.discard("copy")
    del torch_backend.WEIGHT_FORMATS["copy"]
    sys.modules.pop("head_copy")
    r = invoke("verify", out, "--device", "cpu")
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    assert "copy" in ir_node.WEIGHT_FORMATS and load_weight_format("copy") and not load_weight_format("nothing")


def test_a_plugin_format_with_its_bits_is_priced():
    node = ir_node.Node.make("linear", in_features=64, out_features=32, dtype="bfloat16", format="bfloat16",
                             kernel="torch", weight="w")
    torch_backend.register_weight_format("test-nibbles", lambda node, w, dtype: None, bits=4)
    try:
        assert matmul_weight_bytes(node.replace(format="test-nibbles")) == (64 * 32 / 2, 0.0)
    finally:
        ir_node.WEIGHT_FORMATS.discard("test-nibbles")
        ir_node.FORMAT_BITS.pop("test-nibbles")
        torch_backend.WEIGHT_FORMATS.pop("test-nibbles")


def test_a_plugin_kernel_is_registered_listed_and_checked_against_its_reference(site):
    site.install("doubling", {"specpilot.kernels": {"double": "doubling"}}, {"doubling": """
        import torch
        from specpilot.kernels.registry import KernelSpec, register

        register(KernelSpec(
            name="double", run=lambda x: x + x, reference=lambda x: 2 * x,
            make_inputs=lambda case, device, seed: (torch.randn(case["n"], generator=torch.Generator().manual_seed(seed)),),
            cases=[{"n": 7}, {"n": 64}], tolerance={torch.float32: (0.0, 0.0)},
            corrupt=lambda inputs: (inputs[0] + 1.0,)))
        """})
    assert load_kernel("double") and not load_kernel("nothing")
    assert check_kernel(KERNELS["double"]) == []
    wrong = KernelSpec("half", lambda x: x * 0.5, lambda x: 2 * x, KERNELS["double"].make_inputs, [{"n": 3}],
                       {torch.float32: (0.0, 0.0)})
    assert "differs from its reference" in check_kernel(wrong)[0]
    r = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["passes"])
    assert r.exit_code == 0 and re.search(r"kernel\s*│\s*double\s*│\s*plugin doubling 0.1", r.output), r.output


# ----------------------------------------------------------------------------- broken plugins

PASS_HEAD = """
from dataclasses import dataclass
from specpilot.passes import Pass, PassResult, register
"""

BROKEN = {
    "no-import": ("import specpilot_no_such_module\n", "cannot be imported: ModuleNotFoundError: No module named "
                                                        "'specpilot_no_such_module'"),
    "boom": ("""
@register
@dataclass(frozen=True)
class Boom(Pass):
    name = "boom"

    def apply(self, program):
        return 1 / 0
""", "pass 'boom' raised in apply: ZeroDivisionError: division by zero (a fault of the plugin, not of the pipeline)"),
    "checks-boom": ("""
@register
@dataclass(frozen=True)
class ChecksBoom(Pass):
    name = "checks-boom"

    def check(self, program, where=""):
        raise KeyError("limits")
""", "pass 'checks-boom' raised in check: KeyError: 'limits'"),
    "bad-ir": ("""
@register
@dataclass(frozen=True)
class BadIr(Pass):
    name = "bad-ir"

    def apply(self, program):
        name, node = program.step.one("verify")
        return PassResult(program.with_graph("step", program.step.with_node(name, node.replace(q=99))), True)
""", "pass 'bad-ir' returned an invalid IR: step/verify: q=99"),
    "weights-edit": ("""
@register
@dataclass(frozen=True)
class WeightsEdit(Pass):
    name = "weights-edit"

    def apply(self, program):
        name, node = program.target.one("lm_head")
        return PassResult(program.with_graph("target", program.target.with_node(name, node.replace(out_features=7))),
                          True)
""", "pass 'weights-edit' returned an invalid IR: "),
    "in-place": ("""
@register
@dataclass(frozen=True)
class InPlace(Pass):
    name = "in-place"

    def apply(self, program):
        name, node = program.step.one("commit")
        program.step.dag.nodes[name]["node"] = node.replace(kv="compact")
        return PassResult(program, True)
""", "pass 'in-place' changed the program it was given in place"),
    "not-a-result": ("""
@register
@dataclass(frozen=True)
class NotAResult(Pass):
    name = "not-a-result"

    def apply(self, program):
        return program
""", "pass 'not-a-result' returned Program, expected a PassResult holding a Program"),
    "mutable": ("""
@register
class Mutable(Pass):
    name = "mutable"
    size: int = 3
""", "pass 'mutable': Mutable must be a frozen dataclass"),
    "weights-u12": ("""
@register
@dataclass(frozen=True)
class Clash(Pass):
    name = "weights-u12"
""", "pass 'weights-u12': the name is taken by the built-in pass 'weights-u12'; the plugin must rename its pass"),
}


@pytest.fixture
def broken(site):
    classes = {"no-import": "Anything", "mutable": "Mutable", "weights-u12": "Clash"}
    entries = {name: f"broken_{name.replace('-', '_')}:{classes.get(name) or name.title().replace('-', '')}"
               for name in BROKEN}
    entries["clashes"] = entries.pop("weights-u12")  # the module registers `weights-u12` on import
    return site.install("broken", {"specpilot.passes": entries},
                        {f"broken_{name.replace('-', '_')}": PASS_HEAD + text for name, (text, _) in BROKEN.items()})


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_plugin_is_one_error_naming_the_plugin_and_the_pass(broken, tmp_path, name):
    passes = "clashes" if name == "weights-u12" else name
    r = invoke("compile", write_spec(tmp_path), "--passes", passes, "-o", tmp_path / "e", "--device", "cpu")
    assert_user_error(r, "plugin broken 0.1: pass ", BROKEN[name][1])
    assert f"pass '{name}'" in r.output
    assert not (tmp_path / "e").exists()
    assert name == "weights-u12" or name not in REGISTRY or origin_of(REGISTRY[name]) == broken


def test_a_broken_plugin_never_breaks_what_does_not_ask_for_it(broken, tmp_path):
    r = invoke("explain", write_spec(tmp_path, 'passes: "draft-block-size{size=3}"'), "--tau", "2")
    assert r.exit_code == 0, r.output
    assert not [m for m in sys.modules if m.startswith("broken_")]
    r = CliRunner(env={"COLUMNS": "300"}).invoke(main, ["passes"])
    assert r.exit_code == 0, r.output
    assert ("broken plugin: plugin broken 0.1: pass 'no-import' (broken_no_import:Anything): cannot be imported: "
            "ModuleNotFoundError") in r.output
    assert "pass 'weights-u12': the name is taken by the built-in pass" in r.output
    assert "boom" in REGISTRY and REGISTRY["weights-u12"].__module__ == "specpilot.passes.weights_u12"
    # a spec that names the broken plugin asks for all of it
    r = invoke("compile", write_spec(tmp_path, "plugins: [broken]"), "-o", tmp_path / "e")
    assert_user_error(r, "pipeline.yaml: field 'plugins': plugin broken 0.1: pass ")


# ----------------------------------------------------------------------------- the worked example, installed by pip


def cli(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from specpilot.cli import main; main()", *map(str, args)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # ~17 CPU-s: a pip build and three CLI processes (~2.5 s of imports each), one a compile
def test_the_worked_example_installs_compiles_and_shows_in_explain(tmp_path):
    """docs/WRITING-PASSES.md end to end: pip installs examples/specpilot-verify-width (a copy: the
    build leaves files beside the sources), the CLI in a fresh process finds its pass by the entry
    point, compiles with it (token forcing passes), and `explain` prices what it did. In-process
    tests above cover the listing, the errors and the what-ifs with the same module."""
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, source)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "--target", str(target), str(source)],
                         capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)]), "COLUMNS": "250"}

    out = tmp_path / "engine"
    spec = write_spec(tmp_path, 'passes: "verify-width{q=6}"', kind="dflash")
    compiled = cli(env, "compile", spec, "-o", out, "--device", "cpu")
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr
    assert "verify 4 -> 6 tokens (chain)" in compiled.stdout
    assert json.loads((out / "report.json").read_text())["pipeline"] == "verify-width{q=6}"
    assert json.loads((out / "validation.json").read_text())["passed"]
    assert "block_size=6" in (out / "ir.txt").read_text() and "q=6" in (out / "ir.txt").read_text()

    # the example's pipeline (the zoo pair, verify-width{q=8}) against the stock block of 16: a narrower
    # verify, a lower τ (test_a_plugin_schedule_space_... shows the program is a block of 8's)
    example = EXAMPLE / "pipeline.yaml"
    with_plugin, stock = cli(env, "explain", example), cli(env, "explain", example, "--passes", "")
    assert with_plugin.returncode == stock.returncode == 0, with_plugin.stderr

    def row(run, label):
        return re.search(rf"{re.escape(label)}\s*│(.*)", run.stdout).group(1)

    assert float(row(with_plugin, "τ (accepted + 1)").split("│")[0]) < float(row(stock, "τ (accepted + 1)").split("│")[0])
    assert row(with_plugin, "verify step") != row(stock, "verify step")
