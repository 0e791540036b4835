"""The package's structure: every module imports only modules of a lower layer (so there is no import
cycle), collectives on gradients are issued only by ``collectives.py``, and no module grafts
attributes onto objects of another module's class."""
import ast
import pathlib

import pytest
import torch

PKG = pathlib.Path(__file__).resolve().parent.parent / "fp8_comm_hook"

#: Layer of each module (a module inside a subpackage takes the subpackage's layer). A module may
#: import modules of lower layers; inside one subpackage, its modules may import each other (checked
#: for cycles below).
LAYERS = {
    "formats": 0, "config": 0, "geometry": 0, "stats": 0, "registry": 0,
    "layout": 1, "codec": 1,
    "collectives": 2, "graphs": 2, "worker": 2,
    "state": 3, "cast_hook": 3, "autotune": 3,
    "reduce": 4,
    "ddp": 5, "fsdp": 5,
    "integrations": 6,
    "__init__": 7,
}


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        yield ".".join(rel.parts), path


def _internal_imports(name: str, path: pathlib.Path):
    """Package modules ``name`` imports anywhere in its file (lazy imports inside functions too),
    as dotted names relative to the package."""
    parts = name.split(".")
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = base + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "fp8_comm_hook":
                mod = node.module.split(".")[1:]
            else:
                continue
            if node.module is None or not mod:
                for alias in node.names:  # "from . import collectives"
                    out.add(".".join(mod + [alias.name]))
            else:
                out.add(".".join(mod))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "fp8_comm_hook":
                    out.add(".".join(alias.name.split(".")[1:]))
    return {m for m in out if m}


def _layer(mod: str) -> int:
    top = mod.split(".")[0]
    if top not in LAYERS:
        raise AssertionError(f"module {mod} has no layer in LAYERS: add it")
    return LAYERS[top]


GRAPH = {name: _internal_imports(name, path) for name, path in _modules()}


def test_every_import_goes_down_a_layer():
    upward = []
    for mod, deps in GRAPH.items():
        for dep in deps:
            same_subpackage = "." in mod and mod.split(".")[0] == dep.split(".")[0]
            if same_subpackage:
                continue
            if mod == "__init__":
                continue
            if not _layer(dep) < _layer(mod):
                upward.append(f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})")
    assert not upward, "imports that do not go down a layer:\n" + "\n".join(upward)


def test_no_import_cycle():
    known = set(GRAPH)

    def resolve(dep):  # "codec" means "codec.__init__"
        return dep if dep in known else f"{dep}.__init__"

    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            d = resolve(d)
            if d not in known:
                continue
            if state.get(d) == "open" and not m.endswith("__init__") and not d.endswith("__init__"):
                raise AssertionError("import cycle: " + " -> ".join(stack + [m, d]))
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in sorted(known):
        if m not in state:
            visit(m, [])


@pytest.mark.parametrize("call", ["all_to_all_single", "all_gather", "reduce_scatter", "all_reduce(", "broadcast("])
def test_collectives_issued_only_by_collectives_module(call):
    """``dist.<collective>`` appears in collectives.py only (the public ``all_reduce`` of reduce.py is a
    function of this package, not a torch.distributed call)."""
    hits = []
    for name, path in _modules():
        if name == "collectives":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if f"dist.{call}" in line:
                hits.append(f"{name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


#: The only attribute assignments on objects that are not ``self``, with why each is allowed.
ALLOWED_FOREIGN_SETATTR = {
    # FSDP1's register_comm_hook gives every unit one state object and no per-unit API: each unit's
    # hook state (FSDP1's own attribute, which it passes to the hook) is replaced by one naming the unit.
    ("fsdp", "m._comm_hook_state"),
}


def test_no_attribute_grafting():
    found = set()
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            for t in targets:
                for sub in (t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id not in ("self", "cls"):
                        found.add((name, f"{sub.value.id}.{sub.attr}"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
                obj = node.args[0]
                if not (isinstance(obj, ast.Name) and obj.id == "self"):
                    found.add((name, "setattr(" + ast.unparse(obj) + ", ...)"))
    assert found == ALLOWED_FOREIGN_SETATTR, f"unexpected: {sorted(found - ALLOWED_FOREIGN_SETATTR)}; " \
                                             f"gone (update the list): {sorted(ALLOWED_FOREIGN_SETATTR - found)}"


def test_state_and_layout_declare_their_fields():
    """``FP8CommState`` and the layouts declare every field in ``__slots__``: nothing can be grafted on."""
    from fp8_comm_hook import FP8CommState
    from fp8_comm_hook.layout import BucketLayout, PooledLayout

    state = FP8CommState()
    with pytest.raises(AttributeError):
        state.grafted = 1
    for cls in (BucketLayout, PooledLayout):
        layout = cls([100, 30], [0, 100], ["a", "b"], 2, 0, 16, "tensor", 130, torch.float32, torch.device("cpu"))
        with pytest.raises(AttributeError):
            layout.grafted = 1
        assert not hasattr(layout, "__dict__")


def test_public_names_stay_importable():
    import fp8_comm_hook

    for name in fp8_comm_hook.__all__:
        assert getattr(fp8_comm_hook, name) is not None, name
    for name in ("FP8CommConfig", "FP8CommState", "FP8Format", "add_cli_args", "all_reduce", "config_from_args",
                 "fp8_hook", "get_format", "register_ddp_hook", "register_fsdp_hook", "register_grad_comm"):
        assert name in fp8_comm_hook.__all__
