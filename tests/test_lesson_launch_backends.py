"""A lesson's launch gets nccl only when its worker puts its tensors on the rank's GPU.

``devices.backend_for`` returns "nccl" on the multi-gpu profile, and NCCL takes CUDA tensors
only (torch/distributed/distributed_c10d.py, ``Backend.backend_capability``). A launch whose
worker keeps its model and data on the CPU must therefore pass ``backend="gloo"`` (or set up its
own group): on the cpu profile it passes either way, and only a GPU machine would show the bug.
"""
import ast
import importlib
import inspect
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "lessons").glob("[0-9][0-9]_*.py"))

# What a worker that follows the rank's device calls or names (directly or in its source).
GPU_AWARE = ("setup_rank", "rank_device", "device_for_rank", "cuda")
# Workers that move no tensor at all: any backend serves them.
TENSOR_FREE = {"hello"}


def _lesson_tree(path):
    return ast.parse(path.read_text())


def _string_names(tree):
    """Module-level ``name = "literal"`` assignments: a lesson's ``backend = "gloo"``."""
    out = {}
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _dpcourse_aliases(tree):
    """The lesson's ``from dpcourse import x as y`` names: y -> the module dpcourse.x."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dpcourse"):
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _code_names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _sources_with_callees(fn, depth=3, seen=None):
    """fn's source and, `depth` calls deep, that of the dpcourse functions it names: a worker
    that hands its work to ``train_run`` finds its device there."""
    seen = set() if seen is None else seen
    if fn in seen:
        return []
    seen.add(fn)
    out = [textwrap.dedent(inspect.getsource(fn))]
    if depth:
        for name in _code_names(fn.__code__):
            callee = fn.__globals__.get(name)
            if (inspect.isfunction(callee)
                    and getattr(callee, "__module__", "").startswith("dpcourse")):
                out += _sources_with_callees(callee, depth - 1, seen)
    return out


def _worker_source(fn_node, tree, source, aliases):
    """The worker's source: a function the lesson defines, or a dpcourse function."""
    if isinstance(fn_node, ast.Name):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == fn_node.id:
                return node.name, ast.get_source_segment(source, node)
        return fn_node.id, None
    if isinstance(fn_node, ast.Attribute) and isinstance(fn_node.value, ast.Name):
        module = aliases.get(fn_node.value.id)
        if module:
            fn = getattr(importlib.import_module(module), fn_node.attr)
            return fn_node.attr, "\n".join(_sources_with_callees(fn))
    return ast.unparse(fn_node), None


def _launches():
    for path in LESSONS:
        source = path.read_text()
        tree = ast.parse(source)
        strings, aliases = _string_names(tree), _dpcourse_aliases(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "spawn" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "launch" and node.args):
                backend = next((kw.value for kw in node.keywords if kw.arg == "backend"), None)
                yield path.name, node.lineno, backend, strings, \
                    _worker_source(node.args[0], tree, source, aliases)


def _may_be_nccl(backend, strings):
    if backend is None:                                  # the worker sets up its own group
        return False
    if isinstance(backend, ast.Constant):
        return backend.value == "nccl"
    if isinstance(backend, ast.Name) and backend.id in strings:
        return strings[backend.id] == "nccl"
    return True                                          # backend_for(...): nccl on multi-gpu


def test_the_scan_finds_the_lessons_launches():
    found = list(_launches())
    assert len(found) > 20
    assert any(name.startswith("09_") and worker[0] == "local_sgd_worker"
               for name, _, _, _, worker in found)


@pytest.mark.parametrize("lesson,line,backend,strings,worker",
                         [pytest.param(*x, id=f"{x[0]}:{x[1]}") for x in _launches()])
def test_a_launch_that_may_get_nccl_has_a_worker_on_the_ranks_gpu(lesson, line, backend,
                                                                   strings, worker):
    if not _may_be_nccl(backend, strings):
        return
    name, source = worker
    if name in TENSOR_FREE:
        return
    assert source is not None, (f"{lesson}:{line}: cannot find the source of the worker {name}, "
                                "launched with a backend that is nccl on the multi-gpu profile")
    assert any(marker in source for marker in GPU_AWARE), (
        f"{lesson}:{line}: {name} is launched with backend={ast.unparse(backend)}, which is nccl "
        "on the multi-gpu profile, but it never puts its tensors on the rank's GPU "
        f"(none of {', '.join(GPU_AWARE)} in its source): NCCL refuses CPU tensors; pass "
        'backend="gloo"')


def test_lesson_09s_local_sgd_launch_gets_gloo():
    (hit,) = [x for x in _launches() if x[0].startswith("09_") and x[4][0] == "local_sgd_worker"]
    _, _, backend, strings, _ = hit
    assert not _may_be_nccl(backend, strings)
    assert (backend.value if isinstance(backend, ast.Constant) else strings[backend.id]) == "gloo"
