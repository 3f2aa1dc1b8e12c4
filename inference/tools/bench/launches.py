"""Launch counter: the device ops and host syncs of one decode step and of one prefill call, per module kind,
per route, on a CPU machine (`python -m inference.tools.bench launches`).

    python -m inference.tools.bench launches                        # fixture and released, every route
    python -m inference.tools.bench launches --shapes released --routes tilelang,torch --batches 1,32 --json
    python -m inference.tools.bench launches --top 12               # and the busiest functions

A GPU decode step is bound by the host launching kernels, ~17 us of host time each (docs/benchmarks.md §5):
the number of launches a step dispatches is its cost model. This tool counts them without a GPU:

* the CUDA routes run on fake CUDA tensors (torch's FakeTensorMode: shapes, dtypes and devices, no values;
  a CUDA build of torch is needed, no GPU): `torch` is `--kernel-backend torch` (the fast order on CUDA),
  `tilelang` the kernel route with the compiled kernels stubbed, each kernel call counted as one launch;
* the CPU orders (`exact`, `fast`, `invariant`) run on real CPU tensors of random weights, where an op is a
  dispatch, not a launch, but costs host time alike.

What counts as a launch: every aten op on a tensor of the model's device that computes (views, allocations
without a fill and metadata excluded), a dtype cast that copies (`.to`, whose schema marks an alias because it
may return its input), a copy between devices, a TileLang kernel; one op may launch more than one kernel (a
sort, a top-k), so the counts are a floor. `ops` also counts the allocations: every aten op
dispatched on the device, what the host spends its time on. Host syncs on CUDA: every value read on the host
(item, tolist, bool, a nonzero, a bincount, a boolean-mask index, a copy to the host, cuda.synchronize), with
a stand-in value so that the run goes on (a bincount's counts read as its selections spread evenly over the
experts, as a prefill that reaches every expert it can). Each op is charged to the kind of the innermost
module it runs in (module_kind) and to its place, the innermost project function on the Python stack.

Shapes: `fixture` is tests/fixtures/reference-tiny (8 layers); `released` the released config.json's 40
backbone layers with their roles, 384 experts top-6, window 128, index top-512, at small widths (no count
depends on a width). The decode step follows a prefill of --prompt tokens (301, as the conformance fixture).
Time on 2 cores: about 10 s a route for the fixture, 30 s for a released decode step, minutes for a released
prefill of 301 tokens (every expert loops).
"""
import argparse
import collections
import contextlib
import json
import os
import sys
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ...config import ModelArgs, RuntimeOptions
from .common import ROOT

FIXTURE_CONFIG = os.path.join(ROOT, "tests", "fixtures", "reference-tiny", "config.json")
RELEASED_CONFIG = os.path.join(ROOT, "config.json")
SHAPES = ("fixture", "released")
CUDA_ROUTES = ("tilelang", "torch")
CPU_ROUTES = ("exact", "fast", "invariant")
ROUTES = CUDA_ROUTES + CPU_ROUTES
KINDS = ("attention", "indexer", "compressor", "routed experts", "shared expert", "gate", "Engram",
         "hyper-connections", "norms", "embedding", "head", "sampling", "call setup")
# The released widths shrunk (every count is width-free): the rest of config.json as released.
SMALL_WIDTHS = dict(dim=256, moe_inter_dim=128, q_lora_rank=128, head_dim=128, rope_head_dim=64,
                    o_lora_rank=64, index_head_dim=64, engram_vocab_size=1000, engram_head_dim=32,
                    dspark_markov_rank=64, vision_n_layers=0)
aten = torch.ops.aten
# aten ops that launch nothing on the device: allocation without a fill, metadata, aliasing
ALLOCATIONS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
READS = {"item": 0, "tolist": None, "__bool__": False, "__int__": 0, "__index__": 0, "__float__": 0.0}


def _op_name(func) -> str:
    return func.name().split("::", 1)[-1].split(".", 1)[0]


class DeviceOps(TorchDispatchMode):
    """Counts, per (module kind, place), the ops that launch device work on tensors of `device` ('cuda' or
    'cpu'), and records host syncs on CUDA with a stand-in result. `phase` names what runs; `kinds` is a
    stack of module kinds that the hooks of `attribute` push and pop."""

    def __init__(self, device: str = "cuda", stand_in: bool = False):
        """`stand_in`: the tensors are fake (fake_cuda): a read of a value gets a stand-in; on real tensors
        (a device run of the check) every op runs as it is and is only counted."""
        super().__init__()
        self.device, self.stand_in = device, stand_in
        self.phase = "setup"
        self.kinds: List[str] = []
        self.launches: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.ops: Dict[str, int] = collections.Counter()
        self.syncs: Dict[str, set] = collections.defaultdict(set)
        self.sync_count: Dict[str, int] = collections.Counter()
        self.stand_ins: Dict[int, list] = {}             # what tolist() reads of a stood-in bincount

    # ---- attribution ----

    @staticmethod
    def place() -> str:
        """file:function of the innermost project frame that is not this module's."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(ROOT + os.sep) and path != __file__ and os.sep + "tests" + os.sep not in path:
                name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
                return f"{os.path.relpath(path, ROOT)}:{name}"
            frame = frame.f_back
        return "?"

    def kind_of(self, place: str) -> str:
        if place.startswith("inference/hyper.py"):
            return "hyper-connections"
        if place.startswith("inference/sampling.py"):
            return "sampling"
        if place.startswith("inference/state.py:ForwardCall.") and not place.endswith("per_position"):
            return "call setup"
        return self.kinds[-1] if self.kinds else "call setup"

    def count(self, label: Optional[str] = None, launch: bool = True) -> None:
        """One op dispatched; a launch (not an allocation) is charged to the running module's kind and to
        `label` (default: its place)."""
        self.ops[self.phase] += 1
        if launch:
            place = self.place()
            self.launches[self.phase][(self.kind_of(place), label or place)] += 1

    def record_sync(self, what: str) -> None:
        self.syncs[self.phase].add((what, self.place()))
        self.sync_count[self.phase] += 1

    def total(self, phase: str) -> int:
        return sum(self.launches[phase].values())

    # ---- the dispatch ----

    def _on_device(self, args) -> bool:
        for a in args:
            if isinstance(a, torch.Tensor):
                return a.device.type == self.device
            if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                return a[0].device.type == self.device
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _op_name(func)
        cuda = self.device == "cuda"
        on_device = self._on_device(args) or kwargs.get("device") is not None and \
            torch.device(kwargs["device"]).type == self.device
        if cuda and name in ("_to_copy", "to") and args and isinstance(args[0], torch.Tensor):
            target = kwargs.get("device")
            if target is not None and torch.device(target).type != args[0].device.type:
                if torch.device(target).type == "cpu":
                    self.record_sync("copy to the host")
                self.count()                                               # the copy itself
                return func(*args, **kwargs)
        if cuda and func is aten.copy_.default and args[0].device.type != args[1].device.type:
            if args[0].device.type == "cpu":
                self.record_sync("copy to the host")
            self.count()
            return func(*args, **kwargs)
        if not on_device:
            return func(*args, **kwargs)
        if func.overloadpacket is aten.to:
            out = func(*args, **kwargs)           # an alias in its schema: a launch only when it copies
            if out is not args[0]:
                self.count()
            return out
        if func.namespace == "aten" and not func.is_view:
            self.count(launch=name not in ALLOCATIONS)
        if not cuda or not self.stand_in:
            return func(*args, **kwargs)
        if func is aten.nonzero.default:
            self.record_sync("nonzero")
            return torch.zeros(0, args[0].dim(), dtype=torch.long, device=args[0].device)
        if func is aten.bincount.default:
            self.record_sync("bincount")
            n = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            out = torch.zeros(n, dtype=torch.long, device=args[0].device)
            m = args[0].numel()                       # the selections spread evenly over the n experts
            self.stand_ins[id(out)] = [m // n + (i < m % n) for i in range(n)]
            return out
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default) and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.record_sync("boolean-mask index")        # a data-dependent count: none, here
            if func is not aten.index.Tensor:
                return args[0] if func is aten.index_put_.default else args[0].clone()
            empty = torch.zeros(0, dtype=torch.long, device=args[0].device)
            idx = [j for i in args[1] for j in ([empty] * i.dim() if i is not None and i.dtype == torch.bool
                                                 else [i])]
            return func(args[0], idx)
        return func(*args, **kwargs)


def module_kind(name: str, module: torch.nn.Module) -> Optional[str]:
    """The kind of a model's submodule (None: its parent's)."""
    from ...attention import Attention
    from ...block import Block
    from ...compressor import Compressor
    from ...engram import Engram, EngramHasher
    from ...indexer import Indexer
    from ...layers import ParallelEmbedding, ParallelHead, RMSNorm
    from ...moe import MoE, Gate
    if name.endswith("shared_experts"):
        return "shared expert"
    for cls, kind in ((RMSNorm, "norms"), (Indexer, "indexer"), (Compressor, "compressor"),
                      (Attention, "attention"), (Gate, "gate"), (MoE, "routed experts"),
                      ((Engram, EngramHasher), "Engram"), (Block, "hyper-connections"),
                      (ParallelHead, "head"), (ParallelEmbedding, "embedding")):
        if isinstance(module, cls):
            return kind
    return None


@contextlib.contextmanager
def attribute(model: torch.nn.Module, counter: DeviceOps):
    """Forward hooks that keep counter.kinds as the stack of the running modules' kinds."""
    handles = []

    def leave(module, inputs, output):
        counter.kinds.pop()                 # (a hook's return value would replace the output)

    modules = list(model.named_modules())
    if getattr(model, "engram_hasher", None) is not None:
        modules.append(("engram_hasher", model.engram_hasher))
    for name, m in modules:
        kind = module_kind(name, m)
        if kind is None:
            continue
        handles.append(m.register_forward_pre_hook(lambda mod, inp, kind=kind: counter.kinds.append(kind)))
        handles.append(m.register_forward_hook(leave))
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()


def _nested(shape: list, value):
    """A nested list of `shape` filled with `value` (what tolist() of such a tensor gives)."""
    return value if not shape else [_nested(shape[1:], value) for _ in range(shape[0])]


@contextlib.contextmanager
def fake_cuda(counter: DeviceOps):
    """FakeTensorMode (enter `counter` inside it to count); the reads of values on the host (item, tolist,
    ...) patched for the block to record a sync on `counter` and return a stand-in (tolist: a stood-in
    bincount's spread, else ones), and cuda.synchronize recorded. Needs a CUDA build of torch (no GPU)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    if not torch.backends.cuda.is_built():
        raise RuntimeError("fake CUDA tensors need a CUDA build of torch (no GPU needed)")
    originals = {name: getattr(torch.Tensor, name) for name in READS}
    synchronize = torch.cuda.synchronize

    def reader(name, value):
        def read(self, *args, **kwargs):
            if not self.is_cuda and not isinstance(self, FakeTensor):
                return originals[name](self, *args, **kwargs)
            if self.is_cuda:
                counter.record_sync(f"value read on the host ({name.strip('_')})")
            if name == "tolist":
                return counter.stand_ins.get(id(self)) or _nested(list(self.shape), 1)
            return value
        return read

    fake_tolist = FakeTensor.__dict__.get("tolist")       # (one read per element otherwise)
    try:
        for name, value in READS.items():
            setattr(torch.Tensor, name, reader(name, value))
        if fake_tolist is not None:
            FakeTensor.tolist = torch.Tensor.tolist
        torch.cuda.synchronize = lambda *a, **k: counter.record_sync("cuda.synchronize")
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        if fake_tolist is not None:
            FakeTensor.tolist = fake_tolist
        torch.cuda.synchronize = synchronize


@contextlib.contextmanager
def stubbed_tilelang(counter: DeviceOps):
    """The TileLang route on fake CUDA: a compute capability 9.0 GPU assumed, each compiled kernel replaced by
    a stand-in that counts one launch (its factory never runs: nothing is lowered)."""
    from ... import kernels
    from ...kernels import tilelang_ops as ops
    saved = (kernels._capability, kernels._tilelang_imports, torch.cuda.current_device, ops._compiled)

    def compiled(settings, name, *args):
        return lambda *tensors: counter.count(f"TileLang kernel {name}")

    try:
        kernels._capability = lambda index: (9, 0)
        kernels._tilelang_imports = lambda: True
        torch.cuda.current_device = lambda: 0
        ops._compiled = compiled
        yield
    finally:
        kernels._capability, kernels._tilelang_imports, torch.cuda.current_device, ops._compiled = saved


@contextlib.contextmanager
def counting_tilelang(counter: DeviceOps):
    """On a real GPU: each compiled TileLang kernel still runs, and each call counts one launch."""
    from ...kernels import tilelang_ops as ops
    compiled = ops._compiled

    def counted(settings, name, *args):
        kernel = compiled(settings, name, *args)

        def launch(*tensors):
            counter.count(f"TileLang kernel {name}")
            return kernel(*tensors)
        return launch

    try:
        ops._compiled = counted
        yield
    finally:
        ops._compiled = compiled


# ---- the models ----

def shape_args(shape: str, batch: int, max_seq_len: int) -> ModelArgs:
    if shape == "fixture":
        return ModelArgs.from_file(FIXTURE_CONFIG, max_batch_size=batch, max_seq_len=max_seq_len)
    with open(RELEASED_CONFIG) as f:
        cfg = json.load(f)
    cfg.update(SMALL_WIDTHS)
    from ..synthetic import engram_table_sizes
    cfg["engram_num_embeddings"] = engram_table_sizes(ModelArgs(**dict(cfg, engram_num_embeddings=[])))
    return ModelArgs.from_dict(cfg, max_batch_size=batch, max_seq_len=max_seq_len)


def _tokenizer(shape: str):
    from encoding.tokenizer import load_tokenizer
    if shape == "fixture":
        return load_tokenizer(os.path.dirname(FIXTURE_CONFIG))
    import tempfile
    from encoding.tokenizer import write_v41_tokenizer
    d = tempfile.mkdtemp(prefix="dsv41-launches-")
    write_v41_tokenizer(d)
    return load_tokenizer(d)


def route_options(route: str) -> RuntimeOptions:
    if route == "tilelang":
        return RuntimeOptions(kernel_backend="tilelang")
    if route == "torch":
        return RuntimeOptions(kernel_backend="torch")
    return RuntimeOptions(kernel_backend="torch", order=route)


def count_route(shape: str, route: str, batch: int, prompt: int, tokenizer=None) -> dict:
    """{'decode': {...}, 'prefill': {...}} for one shape, route and batch: each with 'launches', 'syncs',
    'kinds' {kind: n} and 'places' {place: n}."""
    from ...model import Transformer
    from ..synthetic import randomize
    args = shape_args(shape, batch, prompt + 8)
    tokenizer = tokenizer or _tokenizer(shape)
    cuda = route in CUDA_ROUTES
    counter = DeviceOps("cuda" if cuda else "cpu", stand_in=cuda)
    ids = torch.randint(4, min(args.vocab_size, 1000) - 1, (batch, prompt + 1),
                        generator=torch.Generator().manual_seed(1))
    with contextlib.ExitStack() as stack:
        if cuda:
            if route == "tilelang":
                stack.enter_context(stubbed_tilelang(counter))
            stack.enter_context(fake_cuda(counter))
        model = Transformer(args, opts=route_options(route), device="cuda" if cuda else "cpu",
                            tokenizer=tokenizer, build_dspark=False)
        if not cuda:
            randomize(model)
        ids = ids.to("cuda" if cuda else "cpu")
        stack.enter_context(attribute(model, counter))
        if not cuda:
            model.prefill(ids[:, :prompt])             # the CPU orders derive their weight layouts once
        stack.enter_context(counter)
        counter.phase = "prefill"
        model.prefill(ids[:, :prompt])
        counter.phase = "decode"
        model.decode(ids[:, prompt:prompt + 1], prompt)
    out = {}
    for phase in ("decode", "prefill"):
        kinds, places = collections.Counter(), collections.Counter()
        for (kind, place), n in counter.launches[phase].items():
            kinds[kind] += n
            places[place] += n
        out[phase] = {"launches": sum(kinds.values()), "ops": counter.ops[phase],
                      "syncs": counter.sync_count[phase] if cuda else None,
                      "sync_sites": sorted(f"{w} at {p}" for w, p in counter.syncs[phase]),
                      "kinds": dict(kinds), "places": dict(places.most_common())}
    return out


def count_all(shapes, routes, batches, prompt: int, log=print) -> List[dict]:
    rows = []
    for shape in shapes:
        tokenizer = _tokenizer(shape)
        for route in routes:
            if route in CUDA_ROUTES and not torch.backends.cuda.is_built():
                log(f"[{shape}] {route}: skipped, fake CUDA tensors need a CUDA build of torch (no GPU "
                    f"needed)")
                continue
            for batch in batches:
                log(f"[{shape}] {route}, batch {batch}: counting a prefill of {prompt} tokens and a decode "
                    f"step")
                result = count_route(shape, route, batch, prompt, tokenizer)
                for phase, r in result.items():
                    rows.append(dict(shape=shape, route=route, batch=batch, phase=phase, prompt=prompt, **r))
    return rows


def format_rows(rows: List[dict], top: int = 0) -> str:
    head = f"{'shape':9} {'route':9} {'batch':>5} {'phase':8} {'launches':>8} {'ops':>6} {'syncs':>5}  " + \
        "  ".join(f"{k}" for k in KINDS)
    lines = [head]
    for r in rows:
        syncs = "-" if r["syncs"] is None else str(r["syncs"])
        kinds = "  ".join(f"{r['kinds'].get(k, 0):>{len(k)}}" for k in KINDS)
        lines.append(f"{r['shape']:9} {r['route']:9} {r['batch']:>5} {r['phase']:8} {r['launches']:>8} "
                     f"{r['ops']:>6} {syncs:>5}  {kinds}")
        if top:
            for place, n in list(r["places"].items())[:top]:
                lines.append(f"{'':43}{n:>6}  {place}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m inference.tools.bench launches", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}")
    ap.add_argument("--routes", default=",".join(ROUTES), help=f"comma-separated: {', '.join(ROUTES)}")
    ap.add_argument("--batches", default="1", help="comma-separated batch sizes (default 1)")
    ap.add_argument("--prompt", type=int, default=301, help="prompt length before the decode step (301)")
    ap.add_argument("--top", type=int, default=0, help="also list the N functions with the most launches")
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    a = ap.parse_args(argv)
    shapes, routes = a.shapes.split(","), a.routes.split(",")
    for what, given, known in (("shape", shapes, SHAPES), ("route", routes, ROUTES)):
        bad = [g for g in given if g not in known]
        if bad:
            ap.error(f"unknown {what} {bad[0]!r} (expected one of {', '.join(known)})")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        ap.error(f"--batches takes comma-separated integers, got {a.batches!r}")
    if a.prompt < 1 or any(b < 1 for b in batches):
        ap.error("--prompt and every batch size must be at least 1")
    rows = count_all(shapes, routes, batches, a.prompt, log=lambda m: print(m, file=sys.stderr))
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(format_rows(rows, a.top))
    return 0

