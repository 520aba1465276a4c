"""``import loopkv`` initializes no CUDA, imports no Triton, and patches nothing (DESIGN.md §6)."""

import subprocess
import sys
import textwrap


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
