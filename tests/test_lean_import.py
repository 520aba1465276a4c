"""``import loopkv`` initializes no CUDA, imports no Triton, and patches nothing; no module imports in a circle."""

import ast
import pathlib
import subprocess
import sys
import textwrap

import loopkv


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_initializes_no_cuda_imports_no_triton_patches_nothing():
    stdout = _run(
        """
        import sys
        import torch
        def boom(*a, **k):
            raise RuntimeError("CUDA initialized")
        torch.cuda._lazy_init = boom
        torch.cuda.init = boom
        import loopkv
        import loopkv.planning, loopkv.cells, loopkv.ops.codec
        plan = loopkv.Plan.uniform(loops=4, layers=24, option="int4")
        assert "triton" not in sys.modules, "triton imported"
        assert "transformers" not in sys.modules, "transformers imported by import loopkv"
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        assert "loopkv" not in AttentionInterface._global_mapping, "attention interface patched"
        assert "loopkv" not in AttentionMaskInterface._global_mapping, "mask interface patched"
        print("ok", plan.layout.num_cells)
        """
    )
    assert stdout.split() == ["ok", "96"]


def test_registration_happens_when_asked():
    stdout = _run(
        """
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        import loopkv
        assert "loopkv" not in AttentionInterface._global_mapping
        loopkv.register()
        assert "loopkv" in AttentionInterface._global_mapping
        assert "loopkv" in AttentionMaskInterface._global_mapping
        print("ok")
        """
    )
    assert stdout.strip() == "ok"


def _module_imports(path: pathlib.Path, name: str, modules: set[str]) -> set[str]:
    """The loopkv modules ``name`` imports at module level (``if TYPE_CHECKING:`` blocks included, imports
    inside functions not), without its own parent packages (always initialized first)."""
    found: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(node.orelse)
                for handler in getattr(node, "handlers", ()):
                    visit(handler.body)

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def test_no_import_cycles():
    root = pathlib.Path(loopkv.__file__).parent
    paths = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _module_imports(p, m, set(paths)) for m, p in paths.items()}
    done: set[str] = set()

    def walk(module: str, trail: list[str]) -> None:
        if module in trail:
            raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(module):] + [module]))
        if module in done:
            return
        for dep in sorted(graph[module]):
            walk(dep, trail + [module])
        done.add(module)

    for module in sorted(graph):
        walk(module, [])
