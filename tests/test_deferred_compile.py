"""runtime/deferred_compile.py: without CUDA, importing megatron-core through megatron_grpo
leaves torch's compiler unloaded, and a deferred function compiles on its first call to the
same result. Each check runs in a fresh interpreter (the import order is the point)."""

import subprocess
import sys

from tests.support.demo_run import ROOT

PROBE = """
import sys, torch
{first}
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_geglu  # decorates with jit_fuser at import
print(jit.jit_fuser.__module__, jit.jit_fuser.__name__, "torch._dynamo" in sys.modules)
"""


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_megatron_imported_through_the_package_defers_the_compiler():
    assert _run(PROBE.format(first="import megatron_grpo")) == "megatron_grpo.runtime.deferred_compile defer False"


def test_megatron_imported_first_keeps_its_own_fuser():
    """The hook only acts on an import it sees: megatron's own torch.compile, compiler loaded."""
    assert _run(PROBE.format(first="import megatron.core")) == "torch compile True"


def test_a_deferred_function_compiles_on_first_call_to_the_same_result():
    code = """
import sys, torch
from megatron_grpo.runtime.deferred_compile import defer

@defer(backend="eager")
def gelu_mul(x, y):
    return torch.nn.functional.gelu(x) * y

before = "torch._dynamo" in sys.modules
x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.randn(4, 8)
same = torch.equal(gelu_mul(x, y), torch.nn.functional.gelu(x) * y)
print(before, "torch._dynamo" in sys.modules, same, gelu_mul.__name__)
"""
    assert _run(code) == "False True True gelu_mul"
