"""The house rules of megatron_dpp/, checked on the source: imports point one way, the pure core
needs nothing but the standard library, every policy name is spelled once, and the torch transport
path loads no compiled shm_tensor code."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dpp.pipeline import SCHEDULE_NAMES

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dpp"

# package -> the megatron_dpp packages it must not import (directly; indirect imports go through
# a package that is itself checked).
FORBIDDEN = {
    "pipeline": {"sim", "comm", "runtime", "trace", "models", "training", "data", "search",
                 "arguments", "platform", "parallel"},
    "sim": {"comm", "runtime", "models", "training", "data", "search"},
    "comm": {"runtime", "models", "training", "data", "search"},
    "runtime": {"models", "training", "data", "search"},
    "models": {"runtime", "training", "search", "convert"},
    # The parallel layout's flags, checks and split sit under the models, which read them.
    "parallel": {"models", "runtime", "training", "data", "search", "convert", "comm", "sim",
                 "trace", "arguments"},
    "trace": {"sim", "comm", "runtime", "models", "training", "data", "search"},
    "training": {"search", "convert"},
    # Checkpoints and observability sit under the loop: they never import it, nor each other.
    "training.checkpoint": {"training", "runtime", "search", "convert", "arguments"},
    "training.observe": {"training", "models", "data", "search", "convert", "arguments"},
    # The search prices layouts (pipeline, sim) and measures layers (models) and links (comm);
    # it never runs training.
    "search": {"runtime", "training"},
    # The seam to Megatron-Core's internals is a leaf: standard library, torch and megatron.core.
    "mcore": {"pipeline", "sim", "comm", "runtime", "trace", "models", "training", "data",
              "search", "arguments", "platform", "kernels", "parallel"},
}


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _forbidden(package: str, module: str) -> bool:
    """module (megatron_dpp.X.Y...) is inside a package FORBIDDEN[package] names, and not inside
    `package` itself (training.checkpoint may import training.checkpoint.flags, not training.loop)."""
    parts = module.split(".")
    if parts[0] != "megatron_dpp" or len(parts) < 2:
        return False
    inner = ".".join(parts[1:])
    if inner == package or inner.startswith(package + "."):
        return False
    return any(inner == banned or inner.startswith(banned + ".") for banned in FORBIDDEN[package])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package):
    offenders = []
    for path in sorted((PACKAGE / package.replace(".", "/")).rglob("*.py")):
        for module in _imported_modules(path):
            if _forbidden(package, module):
                offenders.append(f"{path.relative_to(PACKAGE.parent)} imports {module}")
    assert not offenders, "\n".join(offenders)


# Top-level modules that packages import (kernels.py: the flag checks, the model builders): they
# never import the packages above them, lazily or not.
MODULE_FORBIDDEN = {
    "kernels.py": {"models", "parallel", "training", "runtime", "search", "convert", "arguments"},
}


@pytest.mark.parametrize("module", sorted(MODULE_FORBIDDEN))
def test_top_level_modules_import_nothing_above_them(module):
    banned = MODULE_FORBIDDEN[module]
    offenders = [name for name in _imported_modules(PACKAGE / module)
                 if name.split(".")[0] == "megatron_dpp" and len(name.split(".")) > 1
                 and name.split(".")[1] in banned]
    assert not offenders, f"megatron_dpp/{module} imports {offenders}"


def test_a_forbidden_import_is_found():
    assert _forbidden("training.checkpoint", "megatron_dpp.training.lr_schedule")
    assert _forbidden("training.observe", "megatron_dpp.training.checkpoint.flags")
    assert not _forbidden("training.checkpoint", "megatron_dpp.training.checkpoint.flags")
    assert not _forbidden("training", "megatron_dpp.training.checkpoint.flags")
    assert _forbidden("models", "megatron_dpp.runtime.executor")
    assert _forbidden("parallel", "megatron_dpp.models.memory_model")
    assert not _forbidden("models", "megatron_dpp.parallel.split")


_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "numpy", "megatron"):
            raise ImportError(f"blocked: {name}")
        return None
sys.meta_path.insert(0, Block())
import pkgutil, importlib, megatron_dpp.pipeline as pipeline
for info in pkgutil.iter_modules(pipeline.__path__):
    importlib.import_module(f"megatron_dpp.pipeline.{info.name}")
from megatron_dpp.pipeline import TaskGraph, make_scheduler
print(make_scheduler("dpp:adaptive", TaskGraph(4, 2, 8), 1).name)
"""


@pytest.mark.timeout(60)
def test_the_pipeline_core_imports_without_torch_numpy_or_megatron():
    result = subprocess.run([sys.executable, "-c", _BLOCKER], capture_output=True, text=True,
                            timeout=50)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "dpp:adaptive"


def test_each_policy_name_is_spelled_once():
    sources = {path: path.read_text() for path in PACKAGE.rglob("*.py")}
    for name in SCHEDULE_NAMES:
        literal = re.compile(rf"""["']{re.escape(name)}["']""")
        places = [f"{path.relative_to(PACKAGE.parent)}:{text[:match.start()].count(chr(10)) + 1}"
                  for path, text in sources.items() for match in literal.finditer(text)]
        assert len(places) == 1, f"{name!r} is spelled in {places}"
        assert places[0].startswith("megatron_dpp/pipeline/registry.py"), places


_TORCH_TRANSPORT = """
import sys, tempfile, torch.distributed as dist
from megatron_dpp import arguments
from megatron_dpp.comm import make_transport
from megatron_dpp.runtime.executor import make_forward_backward_dpp
parser = arguments.build_parser()
args = parser.parse_args(["--p2p-transport", "torch"])
arguments.validate_transport_args(args)
store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
transport = make_transport(args.p2p_transport, peers=[], timeout_s=5)
transport.close()
dist.destroy_process_group()
loaded = sorted(m for m in sys.modules if m.startswith("shm_tensor"))
print(" ".join(loaded))
"""


@pytest.mark.timeout(120)
def test_the_torch_transport_loads_no_compiled_shm_code():
    """shm_tensor.config (pure Python) holds the shm flags' defaults; the transport itself
    (shm_tensor.context over the compiled _C) must stay unloaded under --p2p-transport torch."""
    result = subprocess.run([sys.executable, "-c", _TORCH_TRANSPORT], capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = result.stdout.split()
    assert "shm_tensor._C" not in loaded and "shm_tensor.context" not in loaded, loaded


MODEL_NAMES = {"gpt", "bert", "llama"}
# Megatron-LM's entry points by name: each fixes its model, one line.
MODEL_ALIAS_ENTRIES = {"pretrain_gpt.py", "pretrain_bert.py", "pretrain_llama.py"}


def test_no_model_is_named_outside_the_models_package():
    """Only megatron_dpp/models/ knows what a model is: elsewhere no string constant is a model's
    name (the rest takes a ModelSpec or a ModelFamily), the entry-point aliases aside, and the
    Hugging Face converters (convert/), whose files name Hugging Face's model types ("llama")."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("models", "convert") or str(relative) in MODEL_ALIAS_ENTRIES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and node.value.lower() in MODEL_NAMES:
                offenders.append(f"megatron_dpp/{relative}:{node.lineno} {node.value!r}")
    assert not offenders, "model names outside megatron_dpp/models/: " + ", ".join(offenders)


# Only pipeline/placement.py computes where a stage is: the rest asks a Placement (its stage,
# location, first and last stage). Each pattern is matched against every comparison and
# arithmetic expression of the code (ast.unparse: comments and docstrings never match).
PLACEMENT_MODULE = PACKAGE / "pipeline" / "placement.py"
PLACEMENT_CHECKED = ("pipeline", "runtime", "sim", "training/observe")
STAGE_ARITHMETIC = [
    re.compile(r"\b(chunk|c) \* (\w+\.)*P\b"),  # chunk * P (+ rank): the interleaved stage
    re.compile(r"\* (\w+\.)*P \+"),
    re.compile(r"% (\w+\.)*P\b"),  # stage % P, stage // P: the interleaved location
    re.compile(r"// (\w+\.)*P\b"),
    re.compile(r"== (\w+\.)*(P|pp_size) - 1\b"),  # rank == P - 1: the last stage's rank
    re.compile(r"== (\w+\.)*V - 1\b"),  # chunk == V - 1: the last stage's chunk
    re.compile(r"\b(rank|pp_rank) == 0\b"),  # rank == 0: the first stage's rank
    re.compile(r"\b(P|num_stages) - 1 - (\w+\.)*(rank|r)\b"),  # the V's way back up
]


def _stage_arithmetic(source: str, filename: str = "<source>") -> list[str]:
    """Every comparison or arithmetic expression of `source` that computes a stage position."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, (ast.Compare, ast.BinOp)):
            text = ast.unparse(node)
            if any(pattern.search(text) for pattern in STAGE_ARITHMETIC):
                found.append(f"{filename}:{node.lineno} {text}")
    return found


def test_nothing_but_the_placement_computes_stage_positions():
    offenders = []
    for package in PLACEMENT_CHECKED:
        for path in sorted((PACKAGE / package).rglob("*.py")):
            if path != PLACEMENT_MODULE:
                offenders += _stage_arithmetic(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not offenders, "ask pipeline/placement.py instead: " + "; ".join(offenders)


@pytest.mark.parametrize("planted", [
    "stage = chunk * self.P + rank",
    "rank, chunk = stage % graph.P, stage // graph.P",
    "last = self.rank == self.graph.P - 1 and chunk == self.V - 1",
    "first = layout.pp_rank == 0",
    "is_last = layout.pp_rank == layout.pp_size - 1",
    "way_back = 2 * P - 1 - rank",
])
def test_planted_stage_arithmetic_is_found(planted):
    assert _stage_arithmetic(planted)


def test_other_arithmetic_is_not_stage_arithmetic():
    assert not _stage_arithmetic('num_stages = P * V\nwarmup = 2 * (P - rank - 1)\n'
                                 'text = "chunk * P + rank"  # rank == P - 1\n')
