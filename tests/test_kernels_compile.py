"""Every kernel source in ``raw_kernels/`` compiles for sm_90 with the options the loader
passes, on a machine without a GPU, so a kernel that does not compile fails here and not on
the first GPU that loads it.

The options are read from the loader (``graphstash._kernels.compile_options()``: C++17, the
include path and every tunable as ``-D``), not written here; ``nvcc`` stands in for the NVRTC
that CuPy runs on a GPU machine. The kernel names the launchers register must be exactly the
entry points the sources define, and follow NOTE [kernel names] (``raw_kernels/__init__.py``);
the tunables' defaults are written once, in ``gs_tunables.cuh``.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from graphstash import _kernels
from graphstash.reference.activation import ExpertActivation
from raw_kernels import KERNEL_DIR, TUNABLES_HEADER, int_defines

NVCC = shutil.which("nvcc")
NEEDS_NVCC = pytest.mark.skipif(
    NVCC is None, reason="nvcc (the CUDA toolkit) is not installed: the kernel sources cannot "
    "be compiled here")

SOURCES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))
ARCH = "sm_90"
# The spelling NOTE [kernel names] sets: gs_<concern>_<op>[_<type>][_g<0|1|2>][_v<W>]
NAME = re.compile(r"^gs_[a-z]+(?:_[a-z]+)*?(?:_(?P<type>bf16|f16|f32|f64|i32|i64))?(?:_g[012])?"
                  r"(?:_v(?P<width>1|2|4|8|16|32|64))?$")
TYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i32": 4, "i64": 8}


def follows_convention(name: str) -> bool:
    """Whether ``name`` is spelled as NOTE [kernel names] says, ``W`` a whole number of
    elements where the kernel has an element type."""
    match = NAME.match(name)
    if match is None:
        return False
    kind, width = match.group("type"), match.group("width")
    return kind is None or width is None or int(width) % TYPE_BYTES[kind] == 0


ENTRY = re.compile(r"Compiling entry function '(\w+)' for '" + ARCH + "'")


def nvcc_command(source: str, output: str) -> list[str]:
    """The nvcc line that builds ``source`` the way the loader does (its NVRTC options)."""
    return [NVCC, f"-arch={ARCH}", "-cubin", "--split-compile=0", "-Xptxas", "-v",
            *_kernels.compile_options(), "-o", output, str(KERNEL_DIR / source)]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """``{source: (return code, nvcc's output)}``, every source compiled at once."""
    out = tmp_path_factory.mktemp("cubin")
    running = {name: subprocess.Popen(nvcc_command(name, str(out / f"{name}.cubin")),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for name in SOURCES}
    return {name: (proc.wait(timeout=600), proc.stdout.read()) for name, proc in running.items()}


def test_the_sources_are_found():
    assert {"paged_stash.cu", "moe_dispatch.cu", "moe_experts.cu", "moe_routing.cu"} <= set(SOURCES)


@NEEDS_NVCC
@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_with_the_loaders_options(compiled, source):
    code, output = compiled[source]
    assert code == 0, f"nvcc failed on {source}:\n{output}"
    assert ENTRY.search(output), f"{source} defines no entry point:\n{output}"


@NEEDS_NVCC
@pytest.mark.parametrize("source", SOURCES)
def test_entry_points_are_the_ones_the_launchers_register(compiled, source):
    """Every kernel a launcher asks for exists, under a name that follows NOTE [kernel names],
    and no entry point is left out of ``graphstash.warmup()``."""
    registered = {kernel for file, kernels in _kernels.sources().values() if file == source
                  for kernel in kernels}
    defined = set(ENTRY.findall(compiled[source][1]))
    assert registered, f"no launcher registers {source}"
    assert sorted(registered - defined) == [], f"registered but not defined in {source}"
    assert sorted(defined - registered) == [], f"defined in {source} but not registered"
    assert sorted(n for n in defined if not follows_convention(n)) == [], "see NOTE [kernel names]"


def test_activation_kinds_are_numbered_as_the_launcher_numbers_them():
    """The launcher passes KINDS.index(kind); the kernel's GS_ACT_* must say the same."""
    from graphstash.reference.activation import KINDS

    defines = int_defines("moe_experts.cu")
    assert {k: defines[f"ACT_{k.upper()}"] for k in KINDS} == {k: i for i, k in
                                                                enumerate(KINDS)}


def test_the_silu_kernels_are_registered_beside_the_generic_ones():
    """NOTE [plain SiLU kernels] (moe_experts.cu): a gs_expert_silu_* kernel for every plain
    and gated gs_expert_act_* one (every dtype and width), none for interleaved gate and up."""
    source, kernels = _kernels.sources()["moe_experts"]
    generic = {k for k in kernels if k.startswith("gs_expert_act_")}
    silu = {k for k in kernels if k.startswith("gs_expert_silu_")}
    assert source == "moe_experts.cu" and generic | silu == set(kernels)
    assert len(generic) == 2 * 4 * 3 * 2          # fwd/bwd, dtypes, layouts, widths
    assert silu == {k.replace("_act_", "_silu_") for k in generic if "_g2_" not in k}
    assert all(follows_convention(k) for k in kernels)


SILU_CASES = [   # (activation, gated, interleaved, bias): whether the SiLU kernels compute it
    (ExpertActivation(), False, False, False, True),
    (ExpertActivation(), True, False, False, True),
    (ExpertActivation(), False, True, False, True),     # plain: interleaving means nothing
    (ExpertActivation(alpha=1.702, gate_cap=3.0), True, False, False, True),   # unused by SiLU
    (ExpertActivation(), True, True, False, False),     # interleaved: generic only
    (ExpertActivation(), True, False, True, False),
    (ExpertActivation(gate_limit=7.0), True, False, False, False),
    (ExpertActivation(gate_limit=1e300), True, False, False, False),    # the kernel clamps
    (ExpertActivation(up_limit=7.0), True, False, False, False),
    (ExpertActivation(up_cap=3.0), True, False, False, False),
    (ExpertActivation(up_offset=1.0), True, False, False, False),
    (ExpertActivation("glu_alpha"), True, False, False, False),
    (ExpertActivation("relu"), False, False, False, False),
]


@pytest.mark.parametrize("act,gated,interleaved,bias,silu", SILU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_launcher_picks_the_silu_kernels_where_they_compute_the_same(monkeypatch, act, gated,
                                                                        interleaved, bias, silu,
                                                                        dtype):
    """SiLU with no clamp (both limits infinite), no softcap or offset on up, no bias and gate
    and up not interleaved runs gs_expert_silu_*, the rest gs_expert_act_* (the names are
    chosen on the host: no GPU needed); with PLAIN_SILU off, everything the generic ones."""
    from graphstash._kernels import experts

    ffn = 16
    pre = torch.zeros(4, 2 * ffn if gated else ffn, dtype=dtype)
    b = torch.zeros(3, pre.shape[1], dtype=dtype) if bias else None
    layout = 2 if gated and interleaved else int(gated)
    width = {torch.bfloat16: 16, torch.float32: 32}[dtype]
    name = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    registered = _kernels.sources()["moe_experts"][1]
    for way in ("fwd", "bwd"):
        expected = f"gs_expert_{'silu' if silu else 'act'}_{way}_{name}_g{layout}_v{width}"
        assert experts._variant(way, pre, gated, interleaved, ffn, act.check(), b) == expected
        assert expected in registered
    monkeypatch.setattr(experts, "PLAIN_SILU", False)
    assert experts._variant("fwd", pre, gated, interleaved, ffn, act.check(), b) == (
        f"gs_expert_act_fwd_{name}_g{layout}_v{width}")


def test_the_names_the_check_refuses():
    """The name check can fail: the suffixes the kernels used before the convention."""
    for name in ("gs_moe_combine_bf16_p8", "gs_expert_act_fwd_f32_g1_v1", "gs_stash_v3",
                 "moe_gather_v16", "gs_route_place_I64", "gs_expert_act_fwd_bf16_g1_v16_p"):
        assert not follows_convention(name), name
    for name in ("gs_stash_v16", "gs_moe_combine_f64_v8", "gs_expert_act_bwd_bf16_g0_v16",
                 "gs_expert_silu_fwd_f32_g1_v4", "gs_route_layout", "gs_route_count_i32",
                 "gs_moe_weight_grad_f16"):
        assert follows_convention(name), name


def test_the_loader_passes_the_tunables_of_the_header(monkeypatch):
    """Each tunable reaches the compiler once, with the default ``gs_tunables.cuh`` holds
    (GRAPHSTASH_TUNABLES unset), and the block size launched is the one compiled."""
    monkeypatch.delenv("GRAPHSTASH_TUNABLES", raising=False)
    defaults = int_defines(TUNABLES_HEADER)
    defines = [o for o in _kernels.compile_options() if o.startswith("-D")]
    assert sorted(defines) == sorted(f"-DGS_{name}={defaults[name]}" for name in _kernels.TUNABLES)
    assert _kernels.THREADS == defaults["THREADS"]


@pytest.mark.parametrize("source", sorted(p.name for p in KERNEL_DIR.glob("*.cu*")))
def test_no_source_writes_a_tunable_default_of_its_own(source):
    """The defaults live in ``gs_tunables.cuh`` only: a second ``#define GS_THREADS 256``
    elsewhere would be a default nothing uses (the loader always passes its own)."""
    if source == TUNABLES_HEADER:
        return
    own = set(int_defines(source)) & set(_kernels.TUNABLES)
    assert own == set(), f"{source} defines {sorted(own)}: they belong in {TUNABLES_HEADER}"


@NEEDS_NVCC
@pytest.mark.parametrize("source", SOURCES)
def test_source_alone_gets_the_defaults(source):
    """Preprocessed without the loader's -D options, every tunable a source uses still
    expands (the source includes the header that holds the defaults)."""
    result = subprocess.run([NVCC, "-E", "--std=c++17", f"-I{KERNEL_DIR}", "-x", "cu",
                             str(KERNEL_DIR / source)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    code = "\n".join(line for line in result.stdout.splitlines() if not line.startswith("#"))
    left = sorted({f"GS_{n}" for n in _kernels.TUNABLES} & set(re.findall(r"\bGS_\w+", code)))
    assert left == [], f"{source} uses {left} without including {TUNABLES_HEADER}"


@pytest.mark.gpu
def test_the_loader_compiles_every_registered_kernel_with_nvrtc():
    """On a GPU the loader's own compiler (NVRTC through CuPy) builds every source and finds
    every registered entry point: what nvcc checked above, through the path that runs."""
    import torch

    pytest.importorskip("cupy")
    index = torch.cuda.current_device()
    _kernels.warmup(index)
    for module_name, (source, kernels) in _kernels.sources().items():
        assert _kernels.is_compiled(index, module_name), source
        for kernel in kernels:
            assert _kernels.resident_blocks(index, module_name, kernel) > 0, kernel


def test_warmup_of_modules_refuses_an_unknown_module_naming_it():
    """``warmup(modules=)`` checks the names before it touches CuPy or a GPU."""
    with pytest.raises(ValueError, match=r"warmup\(modules=\): no kernel module \['moe'\]"):
        _kernels.warmup(torch.device("cuda", 0), modules=("moe_exchange", "moe"))
