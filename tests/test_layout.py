"""The floor plan: the project's imports form layers that only point down, with no circle.

    config, parallel, safetensors_io  ->  kernels, quant  ->  layers, rope, hyper, sampling, state,
    kv_cache  ->  modules (attention, compressor, indexer, sparse_attn, moe, engram, vision, block,
    dspark)  ->  model  ->  engine  ->  tools, serve (the HTTP endpoint)  ->  the CLIs (generate.py,
    convert.py)

Every import counts, also one inside a function. `encoding` (the chat format) stands beside the model: the
engine and the CLIs use it, no model module does.
"""
import ast
import os
import re

import pytest

from conftest import ROOT

# Lower number = lower layer. A module may import its own layer (no circle) or any layer below.
LAYERS = [
    ("base", ["inference.config", "inference.parallel", "inference.safetensors_io"]),
    ("kernels", ["inference.kernels", "inference.quant"]),
    ("layers", ["inference.layers", "inference.rope", "inference.hyper", "inference.sampling",
                "inference.state", "inference.kv_cache"]),
    ("modules", ["inference.attention", "inference.compressor", "inference.indexer",
                 "inference.moe", "inference.engram", "inference.vision", "inference.block",
                 "inference.dspark"]),
    ("model", ["inference.model"]),
    ("encoding", ["encoding"]),
    ("engine", ["inference.engine"]),
    ("tools", ["inference.tools", "inference.serve"]),
    ("cli", ["generate", "convert"]),
]


def project_modules():
    """module name -> file path, for every project .py outside tests/."""
    mods = {}
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        if rel != "." and rel.startswith((".", "tests", "demo")) or "__pycache__" in rel:
            continue
        for f in files:
            if f.endswith(".py"):
                parts = [] if rel == "." else rel.split(os.sep)
                name = ".".join(parts + ([] if f == "__init__.py" else [f[:-3]]))
                mods[name] = os.path.join(folder, f)
    return mods


def imports_of(name: str, path: str, known) -> set:
    """Project modules that `name` imports (resolved to the longest known module name)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()

    def add(target: str):
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package.split(".")
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for a in node.names:
                add(f"{base}.{a.name}" if base else a.name)
    return found


def layer_of(module: str) -> int:
    for n, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return n
    raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layout.py")


@pytest.fixture(scope="module")
def graph():
    mods = project_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_every_module_has_a_layer(graph):
    for m in graph:
        if m != "inference":
            layer_of(m)


def test_no_import_circle(graph):
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                circle = stack[stack.index(t):] + [t]
                pytest.fail("import circle: " + " -> ".join(circle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_imports_only_point_down(graph):
    wrong = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
             for m, targets in graph.items() if m != "inference"
             for t in targets if t != "inference" and layer_of(t) > layer_of(m)]
    assert not wrong, "imports that point up:\n" + "\n".join(sorted(wrong))


def test_model_modules_import_no_encoding_and_generate_no_tool(graph):
    below_engine = [m for m in graph if m != "inference" and layer_of(m) <= layer_of("inference.model")]
    assert not [m for m in below_engine if any(t.startswith("encoding") for t in graph[m])]
    assert not [t for t in graph["generate"] if t.startswith("inference.tools")]
    assert not [t for m in graph if m.startswith("inference.tools") for t in graph[m]
                if t in ("generate", "convert")], "a tool imports a CLI"


def test_the_checker_sees_a_circle_and_an_upward_import(tmp_path):
    """The checks above can fail: a made-up package with a circle and a model module importing the engine."""
    pkg = tmp_path / "inference"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "model.py").write_text("from .engine import run\n")
    (pkg / "engine" / "run.py").write_text("from ..model import x\n")
    known = {"inference", "inference.model", "inference.engine", "inference.engine.run"}
    assert imports_of("inference.model", str(pkg / "model.py"), known) == {"inference.engine.run"}
    assert imports_of("inference.engine.run", str(pkg / "engine" / "run.py"), known) == {"inference.model"}
    assert layer_of("inference.engine.run") > layer_of("inference.model")


def test_generate_py_stays_a_thin_cli():
    with open(os.path.join(ROOT, "generate.py"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 350


def test_lines_are_at_most_110_characters():
    long = []
    for folder, _, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        if rel.startswith((".", "demo" + os.sep + "out")) and rel != "." or "__pycache__" in rel:
            continue
        for f in files:
            if f.endswith((".py", ".sh")) or f == "run":
                path = os.path.join(folder, f)
                for n, line in enumerate(open(path, encoding="utf-8"), 1):
                    if len(line.rstrip("\n")) > 110:
                        long.append(f"{os.path.relpath(path, ROOT)}:{n}")
    assert not long, "lines over 110 characters: " + ", ".join(long[:20])


# ---- the model modules read as their math: no numerics mode named in them ----

MODES = ("invariant", "golden", "tilelang", "fast", "exact")
MODEL_FILES = [os.path.join("inference", f"{m}.py") for m in (
    "attention", "block", "compressor", "dspark", "engram", "hyper", "indexer", "kv_cache", "layers", "model",
    "moe", "rope", "sampling", "state", "vision")]


def _config_keys() -> set:
    import dataclasses
    from inference.config import ModelArgs
    return {f.name for f in dataclasses.fields(ModelArgs)}


CONFIG_KEYS = _config_keys()


def modes_named(source: str, path: str = "<string>") -> list:
    """Where a source names a numerics mode (an order or backend) in its code: identifiers, attributes,
    arguments, keywords and string constants. Comments and docstrings may explain; code may not choose."""
    tree = ast.parse(source, path)
    owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, owners) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []

    def check(word: str, node, kind: str):
        if word in CONFIG_KEYS:                      # e.g. YaRN's beta_fast: the config's own name
            return
        parts = [p for p in word.lower().replace(".", "_").split("_") if p]
        if any(p in MODES for p in parts):
            found.append(f"{path}:{node.lineno}: {kind} {word!r}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            check(node.id, node, "name")
        elif isinstance(node, ast.Attribute):
            check(node.attr, node, "attribute")
        elif isinstance(node, ast.arg):
            check(node.arg, node, "argument")
        elif isinstance(node, ast.keyword) and node.arg:
            check(node.arg, node, "keyword")
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            check(node.name, node, "definition")
        elif isinstance(node, ast.alias):
            check(node.asname or node.name, node, "import")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for w in MODES:
                if re.search(rf"\b{w}\b", node.value.lower()):
                    found.append(f"{path}:{node.lineno}: string {node.value[:40]!r}")
    return found


def test_model_modules_name_no_numerics_mode():
    """Every choice of order or rounding points is made once, in inference/kernels (the Numerics a model's
    context carries); a module calls nx.<op> and names none of them."""
    found = []
    for rel in MODEL_FILES:
        path = os.path.join(ROOT, rel)
        found += modes_named(open(path, encoding="utf-8").read(), rel)
    assert not found, "model modules that name a numerics mode:\n" + "\n".join(found)


def test_the_mode_check_can_fail():
    made_up = ('"""A module whose docstring may say invariant, fast or golden."""\n'
               "from . import kernels\n"
               "def f(x, opts, golden=False):\n"
               "    if kernels.is_invariant(opts):\n"
               "        return kernels.invariant.tree_sum(x)\n"
               "    return g(x, fast=True) if opts.order == 'exact' else x\n")
    found = modes_named(made_up)
    for what in ("argument 'golden'", "attribute 'is_invariant'", "attribute 'invariant'", "keyword 'fast'",
                 "string 'exact'"):
        assert any(what in f for f in found), (what, found)
    assert not modes_named('"""Docstrings may say invariant."""\n# and comments: golden\nx = 1\n')


# ---- dependence, not spelling: what a model module reads and writes ----

# RuntimeOptions fields that select a numerics variant: read once, where the numerics and the context are made
# (inference/kernels, inference/state.py), never by a module that computes.
NUMERICS_FIELDS = ("order", "golden", "kernel_backend", "kernel_build", "fix_index_k_publish")
CHOOSERS = {os.path.join("inference", "state.py")}


def _names(node) -> str:
    """`self.ctx.opts` -> 'self.ctx.opts' (names and attributes only, else '')."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _names(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def variant_reads(source: str, path: str = "<string>") -> list:
    """Where a source reads an option field that selects a numerics variant, or tells the variant apart by
    the activation dtype."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Attribute) and node.attr in NUMERICS_FIELDS and \
                _names(node.value).split(".")[-1] == "opts":
            found.append(f"{path}:{node.lineno}: reads {_names(node)}")
        elif isinstance(node, ast.Compare) and any(isinstance(n, ast.Attribute) and n.attr == "act_dtype"
                                                   for n in [node.left, *node.comparators]):
            found.append(f"{path}:{node.lineno}: compares act_dtype")
    return found


def context_writes(source: str, path: str = "<string>") -> list:
    """Where a source sets an attribute on a ModelContext (`ctx.x = ...`, `self.ctx.x += ...`,
    `setattr(ctx, ...)`) after its construction."""
    found = []
    for node in ast.walk(ast.parse(source, path)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and _names(t.value).split(".")[-1] == "ctx":
                found.append(f"{path}:{node.lineno}: sets {_names(t)}")
        if isinstance(node, ast.Call) and _names(node.func) in ("setattr", "object.__setattr__") and \
                node.args and _names(node.args[0]).split(".")[-1] == "ctx":
            found.append(f"{path}:{node.lineno}: setattr on {_names(node.args[0])}")
    return found


def test_model_modules_read_no_numerics_option():
    found = []
    for rel in MODEL_FILES:
        if rel not in CHOOSERS:
            found += variant_reads(open(os.path.join(ROOT, rel), encoding="utf-8").read(), rel)
    assert not found, "model modules that choose a numerics variant themselves:\n" + "\n".join(found)


def test_no_module_sets_an_attribute_on_the_context():
    found = []
    for name, path in project_modules().items():
        if name.startswith("inference"):
            found += context_writes(open(path, encoding="utf-8").read(), os.path.relpath(path, ROOT))
    assert not found, "attributes set on a ModelContext:\n" + "\n".join(found)


def test_the_dependence_checks_can_fail():
    made_up = ("def forward(self, x, ctx):\n"
               "    if self.ctx.opts.fix_index_k_publish or ctx.opts.golden:\n"
               "        self.ctx.prefilling = True\n"
               "    ctx.step += 1\n"
               "    setattr(self.ctx, 'decode_shapes', True)\n"
               "    return x if ctx.act_dtype == torch.float32 else y\n")
    reads, writes = variant_reads(made_up), context_writes(made_up)
    for what in ("reads self.ctx.opts.fix_index_k_publish", "reads ctx.opts.golden", "compares act_dtype"):
        assert any(what in f for f in reads), (what, reads)
    for what in ("sets self.ctx.prefilling", "sets ctx.step", "setattr on self.ctx"):
        assert any(what in f for f in writes), (what, writes)
    assert not variant_reads("y = self.ctx.opts.deterministic_topk\n")
    assert not context_writes("self.x = ctx\n")


def test_the_context_is_frozen_after_construction():
    """The trap: a layer that tried to keep per-call state on the shared context would fail here."""
    import dataclasses
    from inference.config import ModelArgs
    from inference.state import ModelContext
    ctx = ModelContext.build(ModelArgs.from_file(os.path.join(ROOT, "tests", "fixtures", "reference-tiny",
                                                              "config.json"), max_seq_len=8))
    for name, value in (("step", None), ("prefilling", True), ("numerics", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(ctx, name, value)
