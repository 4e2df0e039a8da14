"""What every Numba-CUDA kernel uses on sm_90 (H100, H200), read from ptxas and cuobjdump without a GPU.

Every kernel registered with ``gpu.numba_cuda._device.kernel`` is compiled to
PTX (float32 and float64, compute capability 9.0), assembled by ``ptxas -v``
and, in float32, disassembled by ``cuobjdump -sass`` (:mod:`gpu.sass`).  The
table printed gives, per kernel and float type: registers, spill stores and
loads, static shared memory, threads per block (``*``: not registered, the
default assumed), the theoretical occupancy at that block size, what bounds
it, and the instruction mix of the work loop (:func:`gpu.sass.work_loop`: the
loop region nested in the most loops among those that do useful arithmetic,
the loop the kernel's time goes to), its depth and its useful FLOPs.  Asserted:

* no kernel spills registers to local memory;
* the kernels of the responsibilities, of GMA (its scan included) and of
  the flash attention reach a theoretical occupancy of at least 50% at their
  own block size, which they must register, in float32 (the type
  ``benchmarks/bench_gpu.py`` measures; float64 is printed), and the
  kernels of :data:`FLOAT64_OCCUPANCY` (the responsibilities, the scan's two
  products) in float64 too;
* floating point is at least a given share of the work loop of the kernels
  of :data:`MIN_FP_SHARES` (float32; the loop ``benchmarks/gpu_model.py``
  paces the kernel by): 40% for the responsibilities kernel,
  for the scan's two products, ``scan._chunk_states`` (the write) and
  ``scan._chunk_rows`` (the read and the masked within-chunk term), and for
  GMA's backward through the responsibilities, ``gma._responsibility_rows``,
  and for OVQ's read-out and assignment, ``ovq._predict_kernel``;
* the work loop of the kernels of :data:`MAX_INSTRUCTIONS_PER_FLOP` issues at
  most so many instructions per useful FLOP: caps 3% or more above the counts
  of ptxas 13.0 and 13.5 (:data:`MEASURED`), asserted with those releases only
  (another one skips, saying so).

* every compute kernel of :data:`gpu.work.KERNELS` passes :data:`GATES` (float32): the useful FLOPs of the
  algorithm per instruction its loop region issues, FFMA per shared-memory wavefront and the FADD/FMUL/FFMA share
  of the region, each limit with its reason; the region holds a whole number of the declared source steps.

Every kernel also compiles for sm_80 (A100), from the same lowering.

The table is printed (``pytest -s``, or without ``-n``: the processes of
``pytest -n`` print nowhere) and kept in ``.pytest_cache/d/gpu-ptx/resources-sm90.txt``.
The tools come from the ``nvidia-cuda-nvcc`` (ptxas) and
``nvidia-cuda-cuobjdump`` wheels of the CUDA extras; without them the tests
that need them skip and say which wheel is missing.  The pure functions
(occupancy, the parsers, the classifier, the hot- and work-loop finders,
the useful FLOPs) are tested on hand-worked cases first.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu import sass  # noqa: E402  (after the path set-up above)

#: Minimum theoretical occupancy of the kernels of each role of :data:`gpu.sass.ROLES`.
MIN_OCCUPANCY = 0.5
#: Minimum share of floating-point instructions in the float32 work loop (:func:`gpu.sass.work_loop`), per kernel: ``"responsibilities"`` names the
#: responsibilities kernel (found by its tag, :func:`responsibilities_kernels`), the others are qualified names.
MIN_FP_SHARES = {
    "responsibilities": 0.4,
    "gpu.numba_cuda.scan._chunk_states": 0.4,
    "gpu.numba_cuda.scan._chunk_rows": 0.4,
    "gpu.numba_cuda.gma._responsibility_rows": 0.4,
    "gpu.numba_cuda.ovq._predict_kernel": 0.4,
    "gpu.numba_cuda.ovq._chunk_loop_kernel": 0.4,
}


# --- the pure functions, on hand-worked cases --------------------------------------------------------------------


@pytest.mark.parametrize(
    "threads, registers, shared, blocks, warps, limit",
    [
        # 32 threads, 68 registers: a warp holds ceil(68 * 32 / 256) * 256 = 2304 registers, 65536 // 2304 = 28 warps
        (32, 68, 384, 28, 28, "registers"),
        # 256 threads (8 warps), 32 registers: 1024 a warp, 64 warps by registers, 8 blocks by warps and registers
        (256, 32, 0, 8, 64, "warps"),
        # 128 threads, 255 registers: 8192 a warp, 8 warps, 2 blocks of 4 warps
        (128, 255, 0, 2, 8, "registers"),
        # 256 threads, 16 registers, 48 KB shared: 233472 // (49152 + 1024) = 4 blocks of 8 warps
        (256, 16, 48 * 1024, 4, 32, "shared"),
        # one warp a block, few registers: the 32-block limit leaves half the warps
        (32, 16, 0, 32, 32, "blocks"),
        # 100 shared bytes round up to 128, + 1 KB reserved: 233472 // 1152 = 202 blocks; 2 warps a block: the warp
        # and block limits both give 32 blocks (the warps are named first)
        (64, 24, 100, 32, 64, "warps"),
        # 1024 threads, 64 registers: 2048 a warp, 32 warps by registers, 32 // 32 = 1 block
        (1024, 64, 0, 1, 32, "registers"),
        # 6401 shared bytes round up to 6528, + 1 KB reserved = 7552: 233472 // 7552 = 30 blocks (unrounded, 7425:
        # 31; without the reserve, 35, so the 32-block limit)
        (32, 16, 6401, 30, 30, "shared"),
    ],
)
def test_occupancy_on_hand_worked_cases(threads, registers, shared, blocks, warps, limit):
    occ = sass.occupancy(threads, registers, shared)
    assert (occ["blocks"], occ["warps"], occ["limit"]) == (blocks, warps, limit)
    assert occ["fraction"] == warps / 64


def test_occupancy_refuses_a_block_that_cannot_launch():
    with pytest.raises(ValueError, match=r"\[1, 1024\]"):
        sass.occupancy(2048, 32)


PTXAS_SAMPLE = """\
ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_ZN3gpu4kern' for 'sm_90'
ptxas info    : Function properties for _ZN3gpu4kern
    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 68 registers, used 1 barriers, 384 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 156.059 ms
ptxas info    : Function properties for helper
    40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_ptxas_info_is_read_per_entry_function():
    info = sass.parse_ptxas_info(PTXAS_SAMPLE)
    assert info == {"_ZN3gpu4kern": {"registers": 68, "spill_stores": 8, "spill_loads": 12, "stack": 16, "shared": 384}}


# nvJitLink's verbose log of a relocatable kernel linked with the device runtime: ptxas's lines for the kernel (no
# shared bytes: the linker places the arrays), then the linker's per function
LINK_SAMPLE = """\
ptxas info    : Function properties for _ZN3gpu4loop
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers
info    : 13928 bytes gmem
info    : Function properties for '__nv_static_memcpy_3d':
info    : used 16 registers, used 1 barriers, 0 stack, 3080 bytes smem, 656 bytes cmem[0], 0 bytes lmem
info    : Function properties for '_ZN3gpu4loop':
info    : used 128 registers, used 1 barriers, 16 stack, 24576 bytes smem, 2472 bytes cmem[0], 0 bytes lmem
"""


def test_link_info_gives_each_functions_shared_memory_as_placed_by_the_linker():
    assert sass.parse_link_info(LINK_SAMPLE) == {"__nv_static_memcpy_3d": 3080, "_ZN3gpu4loop": 24576}


SASS_SAMPLE = """\
\tcode for sm_90
\t\tFunction : kern
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
                                                                          /* 0x000ff00000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*0030*/                   FADD R3, R2, -R6 ;                     /* 0x8000000602037221 */
        /*0040*/                   FMUL R3, R3, R3 ;                      /* 0x0000000303037220 */
        /*0050*/                   FFMA.FTZ R7, R3, R8, R7 ;              /* 0x0000000803077223 */
        /*0060*/                   IADD3 R4, P0, R4, 0x4, RZ ;            /* 0x0000000404047810 */
        /*0070*/               @P0 BRA 0x30 ;                             /* 0xfffffff000000947 */
        /*0080*/                   MUFU.EX2 R9, R7 ;                      /* 0x0000000700097308 */
        /*0090*/                   STG.E desc[UR4][R10.64], R9 ;          /* 0x000000090a007986 */
        /*00a0*/                   EXIT ;                                 /* 0x000000000000794d */
        /*00b0*/                   BRA 0xb0;                              /* 0xfffffffc00fc7947 */
\t\tFunction : other
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_sass_is_split_per_function_and_read_line_by_line():
    functions = sass.parse_sass(SASS_SAMPLE)
    assert list(functions) == ["kern", "other"]
    kern = functions["kern"]
    assert len(kern) == 12 and functions["other"] == [(0, "EXIT", "", "")]
    assert kern[5] == (0x50, "FFMA.FTZ", "R7, R3, R8, R7", "")
    assert kern[7] == (0x70, "BRA", "0x30", "@P0")


NVDISASM_SAMPLE = """\
\t.section\t.text.helper,"ax",@progbits
.text.helper:
        /*0000*/                   EXIT ;
\t.section\t.text.kern,"ax",@progbits
.text.kern:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
\t//## File "/src/mod.py", line 12
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   FFMA R2, R0, R0, R1 ;
.L_x_1:
\t//## File "/src/mod.py", line 15 inlined at "/src/mod.py", line 30
        /*0030*/                   FADD R3, R2, R2 ;
\t//## File "/src/mod.py", line 13
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
"""


def _sample_callee(a, b):
    return a * b


def _other_callee(x):
    return -x


def _calls_sample(a, b):
    x = a + b
    y = _sample_callee(a,
                       b)
    return _other_callee(x) + _sample_callee(y, y)


def test_line_info_gives_each_instruction_the_last_line_named_before_it_in_its_function():
    lines = sass.parse_line_info(NVDISASM_SAMPLE)
    # code inlined from another function takes the line it is inlined at
    assert lines == {"helper": {}, "kern": {0x10: 12, 0x20: 12, 0x30: 30, 0x40: 13, 0x50: 13}}


def test_calls_are_found_with_every_line_of_their_statement():
    import inspect

    first = inspect.getsourcelines(_calls_sample)[1]
    found = sass.call_lines(_calls_sample, ["_sample_callee", "_absent"])
    assert found == {"_sample_callee": {first + 2, first + 3, first + 4}, "_absent": set()}
    # the instructions of each call's lines go to it, the rest (and those of no line) to the kernel
    code = [(0x10, "FFMA", "R1, R2, R3, R4", ""), (0x20, "IADD3", "R1, R2, R3, RZ", ""), (0x30, "FADD", "R1, R2, R3", ""),
            (0x40, "EXIT", "", "")]
    split = sass.call_pipes(code, {0x10: first + 3, 0x20: first + 1, 0x30: first + 4}, found)
    assert split["of"] == {0x10: "_sample_callee", 0x20: "kernel", 0x30: "_sample_callee", 0x40: "kernel"}
    assert split["pipes"]["_sample_callee"]["fp32"] == 2 and split["pipes"]["kernel"]["total"] == 2
    assert split["pipes"]["_absent"]["total"] == 0


@pytest.mark.parametrize(
    "opcode, cls",
    [("FFMA.FTZ", "fp"), ("FADD", "fp"), ("FMUL", "fp"), ("DFMA.RM", "fp"), ("MUFU.EX2", "fp"), ("FSETP.GT.AND", "fp"),
     ("FMNMX", "fp"), ("IMAD.WIDE.U32", "int"), ("IADD3", "int"), ("LOP3.LUT", "int"), ("SHF.R.S32.HI", "int"),
     ("ISETP.NE.AND", "int"), ("UIADD3", "int"), ("LDG.E.64", "mem"), ("STG.E", "mem"), ("LDS.128", "mem"),
     ("STS", "mem"), ("LDL", "mem"), ("STL.64", "mem"), ("LDC.64", "mem"), ("ULDC", "mem"), ("BRA", "other"),
     ("EXIT", "other"), ("BAR.SYNC.DEFER_BLOCKING", "other"), ("MOV", "other"), ("S2R", "other"), ("F2I.TRUNC", "other")],
)
def test_each_opcode_has_its_class(opcode, cls):
    assert sass.classify(opcode) == cls


def test_the_hot_loop_is_the_body_of_the_backward_branch():
    kern = sass.parse_sass(SASS_SAMPLE)["kern"]
    assert sass.loops(kern) == [(0x30, 0x70)]  # the parking BRA after EXIT branches to itself: no loop
    body = sass.hot_loop(kern)
    assert [ins[0] for ins in body] == [0x30, 0x40, 0x50, 0x60, 0x70]
    assert sass.mix(body) == {"fp": 3, "int": 1, "mem": 0, "other": 1, "total": 5}
    assert sass.flops(body) == 4  # FADD 1, FMUL 1, FFMA 2


def _line(address, text):
    return f"        /*{address:04x}*/  {text} ;"


def test_the_hot_loop_is_the_largest_innermost_loop_of_the_kernel_body():
    # outer loop 0x10..0xc0 holds two inner loops (0x20..0x40, 3 instructions; 0x50..0xb0, 7); a loop in a called
    # routine after the last EXIT (0xe0..0x100) is not the kernel's
    ops = {0x40: "@P0 BRA 0x20", 0xb0: "@P1 BRA 0x50", 0xc0: "@P2 BRA 0x10", 0xd0: "EXIT", 0x100: "@P3 BRA 0xe0",
           0x110: "RET.REL.NODEC R2 0x0"}
    text = "\t\tFunction : k\n" + "\n".join(_line(a, ops.get(a, "FFMA R1, R2, R3, R1")) for a in range(0, 0x120, 0x10))
    code = sass.parse_sass(text)["k"]
    assert sass.loops(code) == [(0x20, 0x40), (0x50, 0xB0), (0x10, 0xC0)]
    assert [ins[0] for ins in sass.hot_loop(code)] == list(range(0x50, 0xC0, 0x10))
    assert sass.hot_loop(sass.parse_sass("\t\tFunction : k\n" + _line(0, "EXIT"))["k"]) == []


def test_unrolled_work_in_an_outer_loop_is_the_hot_loop():
    # loop 0x0..0xf0: a small staging loop (0x10..0x30, 3 instructions), then 11 unrolled FFMAs in one basic block
    ops = {0x10: "LDG.E R4, desc[UR4][R2.64]", 0x20: "STS [R5], R4", 0x30: "@P0 BRA 0x10", 0xF0: "@P1 BRA 0x0",
           0x100: "EXIT"}
    text = "\t\tFunction : k\n" + "\n".join(_line(a, ops.get(a, "FFMA R1, R2, R3, R1")) for a in range(0, 0x110, 0x10))
    code = sass.parse_sass(text)["k"]
    assert [len(b) for b in sass.basic_blocks(code)] == [1, 3, 12, 1]  # 0x0 | 0x10..0x30 | 0x40..0xf0 | EXIT
    body = sass.hot_loop(code)
    assert [ins[0] for ins in body] == list(range(0x40, 0x100, 0x10))
    assert sass.mix(body)["fp"] == 11 and sass.flops(body) == 22
    assert sass.work_loop(code) == body  # the staging loop is deeper, but does no arithmetic


def test_the_work_loop_is_where_the_flops_are():
    # two loops: 0x0..0x70, 8 integer instructions (the hot loop: the most instructions), then 0x80..0xb0, 3 FFMAs
    ops = {0x70: "@P0 BRA 0x0", 0x80: "FFMA R1, R2, R3, R1", 0x90: "FFMA R1, R2, R3, R1", 0xA0: "FFMA R1, R2, R3, R1",
           0xB0: "@P1 BRA 0x80", 0xC0: "EXIT"}
    text = "\t\tFunction : k\n" + "\n".join(_line(a, ops.get(a, "IADD3 R4, R4, 0x1, RZ")) for a in range(0, 0xD0, 0x10))
    code = sass.parse_sass(text)["k"]
    assert [ins[0] for ins in sass.hot_loop(code)] == list(range(0x0, 0x80, 0x10))
    assert [ins[0] for ins in sass.work_loop(code)] == list(range(0x80, 0xC0, 0x10))
    assert sass.flops(sass.work_loop(code)) == 6 and sass.flops(sass.hot_loop(code)) == 0


@pytest.mark.parametrize(
    "opcode, operands, useful",
    [("FFMA", "R7, R3, R8.reuse, R7", 2), ("FADD", "R11, R9, -R14.reuse", 1), ("FMUL.FTZ", "R3, -|R2|, R4", 1),
     ("DFMA", "R4, R6, UR8, R4", 2), ("HFMA2", "R2, R3, R4, R5", 4),
     # an exp's range reduction and polynomial: saturation, rounding down, immediate constants
     ("FFMA.SAT", "R16, R18, R9, 0.5", 0), ("FFMA.RM", "R17, R16, R11, 12582913", 0),
     ("FFMA", "R19, R18, 1.4426950216293334961, -R13", 0), ("FADD", "R13, R17, -12583039", 0),
     ("DFMA.RP", "R4, R6, R8, R4", 0), ("FMUL", "R3, R2, c[0x0][0x210]", 0), ("FFMA", "R3, R2, R4, RZ", 0),
     ("HFMA2.MMA", "R5, -RZ, RZ, 1.875, 0", 0), ("MUFU.EX2", "R18, R19", 0), ("FSETP.GT.AND", "P0, PT, R9, R10, PT", 0)],
)
def test_useful_flops_are_arithmetic_on_registers_without_expansion_modifiers(opcode, operands, useful):
    assert sass.work_flops([(0, opcode, operands, "")]) == useful


def _epilogue_after_a_product(epilogue):
    """A tiled kernel: loop 0x0..0x140 (tiles) holds loop 0x10..0x70 (chunks), which holds the product loop
    0x20..0x60 (LDS, FADD, FMUL, FFMA: 4 useful FLOPs, depth 3); then ``epilogue`` (address: instruction), a loop
    0x80..0x130 of depth 2 (a combine tree run log2(TX) times a tile)."""
    ops = {0x20: "LDS R2, [R4]", 0x30: "FADD R3, R2, -R6", 0x40: "FMUL R3, R3, R3", 0x50: "FFMA R7, R3, R8, R7",
           0x60: "@P0 BRA 0x20", 0x70: "@P1 BRA 0x10", 0x130: "@P2 BRA 0x80", 0x140: "@P3 BRA 0x0", 0x150: "EXIT",
           0x160: "BRA 0x160", **epilogue}
    text = "\t\tFunction : k\n" + "\n".join(_line(a, ops.get(a, "IADD3 R4, R4, 0x1, RZ")) for a in range(0, 0x170, 0x10))
    return sass.parse_sass(text)["k"]


def test_the_work_loop_is_not_an_exp_epilogue_with_more_raw_flops():
    # the epilogue: the range reduction and polynomial of an exp (FFMA.SAT, FFMA.RM, FFMAs by constants), 2 useful
    # FLOPs (x - m, a product), 17 raw, 12 instructions: the hot loop, not the work loop
    code = _epilogue_after_a_product({
        0x80: "FADD R18, R9, -R14", 0x90: "FFMA.SAT R16, R18, R9, 0.5", 0xA0: "FFMA.RM R17, R16, R11, 12582913",
        0xB0: "FADD R13, R17, -12583039", 0xC0: "FFMA R19, R18, 1.4426950216293334961, -R13",
        0xD0: "FFMA R19, R18, 1.925963033500011079e-08, R19", 0xE0: "MUFU.EX2 R18, R19", 0xF0: "FMUL R17, R17, R18",
        0x100: "FFMA.SAT R20, R12, R9, 0.5", 0x110: "FFMA.RM R21, R20, R11, 12582913",
        0x120: "FFMA R22, R12, 1.4426950216293334961, -R21"})
    product, epilogue = [ins for ins in code if 0x20 <= ins[0] <= 0x60], [ins for ins in code if 0x80 <= ins[0] <= 0x130]
    assert (sass.flops(product), sass.work_flops(product), sass.loop_depth(product, code)) == (4, 4, 3)
    assert (sass.flops(epilogue), sass.work_flops(epilogue), sass.loop_depth(epilogue, code)) == (17, 2, 2)
    assert sass.hot_loop(code) == epilogue
    assert sass.work_loop(code) == product


def test_the_work_loop_is_the_deepest_even_with_fewer_useful_flops():
    # an online softmax's rescaling after the product: 8 useful FLOPs (products and sums of registers) in the loop of
    # depth 2, more than the product's 4 at depth 3; the product runs once per chunk, the rescaling once per tile
    code = _epilogue_after_a_product({a: "FMUL R10, R10, R12" for a in range(0x80, 0x100, 0x10)})
    product = [ins for ins in code if 0x20 <= ins[0] <= 0x60]
    assert sass.work_flops(sass.hot_loop(code)) == 8
    assert sass.work_loop(code) == product


def test_a_deeper_loop_without_useful_flops_is_not_the_work_loop():
    # the product loop's FADD, FMUL, FFMA by constants and with rounding modifiers: no useful FLOP at depth 3; the
    # epilogue's register products are the work
    code = _epilogue_after_a_product({0x30: "FADD R3, R2, -12583039", 0x40: "FMUL.RZ R3, R3, R3",
                                      0x50: "FFMA.SAT R7, R3, R8, 0.5", 0x80: "FMUL R10, R10, R12"})
    assert sass.work_loop(code) == [ins for ins in code if 0x80 <= ins[0] <= 0x130]


def test_roles_come_from_tags_then_modules():
    assert sass.role("gpu.numba_cuda.gmm._rows") == "responsibilities"
    assert sass.role("gpu.numba_cuda.scan._chunk_rows") == sass.role("gpu.numba_cuda.gma._x") == "gma"
    assert sass.role("gpu.numba_cuda.attention._flash") == "attention"
    assert sass.role("gpu.numba_cuda.ovq._readout") is None
    assert sass.role("gpu.numba_cuda.ovq._readout", {"attention"}) == "attention"
    assert sass.role("gpu.numba_cuda.gmm._rows", {"setup"}) == "responsibilities"


# --- every registered kernel -------------------------------------------------------------------------------------

_COMPILE = """
import json, sys
from gpu import sass
json.dump(sass.compile_kernels((9, 0), also=[(8, 0)]), open(sys.argv[1], "w"))
"""


def _tool_or_skip(name):
    path = sass.find_tool(name)
    if path is None:
        pytest.skip(f"{name} not found: the {sass.TOOL_WHEELS[name]} wheel (in the CUDA extras) is not installed")
    return path


def _sources_key():
    """A digest of what the PTX depends on: the kernel modules, the compile code, the numba-cuda version."""
    import hashlib
    from importlib import metadata

    h = hashlib.sha256()
    for path in sorted((ROOT / "gpu" / "numba_cuda").glob("*.py")) + [ROOT / "gpu" / "sass.py"]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in ("numba-cuda", "numba"):
        try:
            h.update(metadata.version(dist).encode())
        except metadata.PackageNotFoundError:
            pass
    return h.hexdigest()[:32]


@pytest.fixture(scope="module")
def compiled(request):
    """``{"ptx": {name: {dtype: ptx}}, "launch": {...}, "also": {"sm_80": {name: {dtype: length}}}}`` of every kernel.

    The PTX is sm_90's; each kernel is lowered once and NVVM writes sm_80's
    PTX from the same IR (:func:`gpu.numba_cuda._device.compile_targets`), so
    the A100's compile check costs no second lowering.

    Compiled in a fresh process with the real CUDA target; kept in pytest's
    cache under a digest of the sources (:func:`_sources_key`), so that an
    unchanged tree is not compiled again.
    """
    _tool_or_skip("ptxas")
    cache = getattr(request.config, "cache", None)  # None with -p no:cacheprovider: a temporary folder then
    folder = cache.mkdir("gpu-ptx") if cache is not None else request.getfixturevalue("tmp_path_factory").mktemp("ptx")
    out = folder / f"sm90-{_sources_key()}.json"
    if not out.is_file():
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([sys.executable, "-c", _COMPILE, str(tmp)], capture_output=True, text=True, cwd=ROOT,
                              env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        os.replace(tmp, out)
    return json.loads(out.read_text())


def _short(name):
    return name.replace("gpu.numba_cuda.", "")


@pytest.fixture(scope="module")
def table(compiled):
    """One row per kernel and float type (:func:`gpu.sass.kernel_rows`); the float32 code disassembled."""
    return sass.kernel_rows(compiled, sass_dtypes=("float32",))


def format_table(rows):
    """The resource table as text (what the tests print): the loop columns are the work loop's."""
    head = (f"{'kernel':36s} {'dtype':7s} {'regs':>4s} {'spill st':>8s} {'spill ld':>8s} {'smem B':>7s} {'threads':>8s} "
            f"{'occupancy':>9s} {'bound by':9s}  {'work loop: instr':>16s} {'depth':>5s} {'flops':>5s} {'fp':>6s} "
            f"{'int':>6s} {'mem':>6s} {'other':>6s}")
    lines = [head]
    for r in rows:
        mix = r["work_loop"]
        if mix is None:
            loop = f"{'':>16s} {'':>5s} {'':>5s} {'':>6s} {'':>6s} {'':>6s} {'':>6s}"
        else:
            n = mix["total"] or 1
            where = "" if r["loop"] else " (no loop)"
            loop = (f"{str(mix['total']) + where:>16s} {r['work_loop_depth']:5d} {r['work_loop_flops']:5d} "
                    + " ".join(f"{100 * mix[c] / n:5.1f}%" for c in sass.CLASSES))
        lines.append(
            f"{_short(r['kernel']):36s} {r['dtype']:7s} {r['registers']:4d} {r['spill_stores']:8d} {r['spill_loads']:8d} "
            f"{r['shared']:7d} {str(r['threads']) + ('*' if r['assumed'] else ''):>8s} {100 * r['occupancy']:8.1f}% "
            f"{r['limit']:9s}  {loop}"
        )
    lines.append("threads marked * are not registered with the kernel: the default of _device.kernel is assumed; "
                 "work loop: gpu.sass.work_loop, its loop depth and useful FLOPs (gpu.sass.work_flops)")
    return "\n".join(lines)


def test_the_resource_table_covers_every_kernel(table, compiled, capsys, request):
    text = "sm_90 resources (ptxas -v) and work-loop instruction mix (cuobjdump -sass, float32)\n" + format_table(table)
    with capsys.disabled():
        print("\n" + text)
    cache = getattr(request.config, "cache", None)
    if cache is not None:  # pytest -n hides what its processes print: the table is kept beside the PTX too
        (cache.mkdir("gpu-ptx") / "resources-sm90.txt").write_text(text + "\n")
    assert sorted({r["kernel"] for r in table}) == sorted(compiled["ptx"])
    assert all(r["registers"] > 0 for r in table), format_table(table)
    if sass.find_tool("cuobjdump") is None:
        pytest.skip(f"no instruction mix: the {sass.TOOL_WHEELS['cuobjdump']} wheel is not installed")
    assert all(r["instructions"] for r in table if r["dtype"] == "float32")


def test_the_cooperative_loop_is_linked_with_the_device_runtime_and_counted_as_it_runs(table, compiled):
    """OVQ's chunk loop calls libcudadevrt (its grid barrier): ptxas assembles it as relocatable code and nvJitLink links
    it, without a GPU, as the driver will; its row counts the shared arrays where the linker places them (ptxas -c
    counts none), no fewer than the module declares, and no spill in either float type."""
    name = "gpu.numba_cuda.ovq._chunk_loop_kernel"
    rows = [r for r in table if r["kernel"] == name]
    assert {r["dtype"] for r in rows} == {"float32", "float64"}
    for r in rows:
        ptx = compiled["ptx"][name][r["dtype"]]
        assert "cudaCGSynchronize" in ptx and ".extern .func" in ptx
        declared = sum(int(n) for n in re.findall(r"^\.visible \.shared .*\[(\d+)\];", ptx, re.MULTILINE))
        assert r["shared"] >= declared > 0 and r["spill_stores"] == 0


_CALLS = """
import json, sys
from gpu import sass
json.dump(sass.kernel_calls(sys.argv[2], sys.argv[3].split(",")), open(sys.argv[1], "w"))
"""


def _kernel_calls(tmp_path, name, calls):
    """:func:`gpu.sass.kernel_calls` of the float32 build of ``name``, in a process compiling for a real GPU."""
    _tool_or_skip("nvdisasm")
    _tool_or_skip("cuobjdump")
    out = tmp_path / "calls.json"
    proc = subprocess.run([sys.executable, "-c", _CALLS, str(out), name, ",".join(calls)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, NUMBA_ENABLE_CUDASIM="0"), timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_loop_kernels_code_is_split_by_the_device_function_each_line_calls(table, tmp_path):
    """benchmarks/gpu_model.py counts OVQ's loop kernel by call: a build with line information (nvdisasm -g) gives each
    instruction the kernel's line that calls it; the build is the plain one's code, the parts add up to it, and the
    work loop lies in the predict item's code, beside a plan and a merge of their own."""
    calls = _kernel_calls(tmp_path, "gpu.numba_cuda.ovq._chunk_loop_kernel", ["_predict_item", "_plan_chunk", "_merge_item"])
    (row,) = [r for r in table if r["kernel"] == "gpu.numba_cuda.ovq._chunk_loop_kernel" and r["dtype"] == "float32"]
    assert calls["instructions"] == row["body_pipes"]["total"]
    assert sum(p["total"] for p in calls["pipes"].values()) == calls["instructions"]
    work_loop = next(r for r in row["regions"] if r["depth"] == row["work_loop_depth"]
                     and r["instructions"] == row["work_loop"]["total"])
    assert calls["region_calls"][str(work_loop["start"])] == "_predict_item"
    # each part is substantial: the plan's sorting networks are the largest, the kernel's own loops the smallest
    sizes = {name: p["total"] for name, p in calls["pipes"].items()}
    assert sizes["_plan_chunk"] > sizes["_predict_item"] > sizes["_merge_item"] > sizes["kernel"] > 0, sizes


def test_the_responsibilities_code_is_split_into_the_parts_the_model_counts_apart(table, tmp_path):
    """benchmarks/gpu_model.py counts the responsibilities kernel's epilogue by call (gpu.work's declaration): the split
    is the plain build's code and adds up to it; the work loop is the kernel's own code; the last, partial stage is a
    stage's product (the loop's floating point); each component tile's epilogue holds RM (RK + 1) exponentials (one an
    entry and one rescale a row) and no branch per entry, the normalisation one a row (RM rows unrolled), its log form
    none."""
    from gpu import work
    from gpu.numba_cuda import gmm

    name = "gpu.numba_cuda.gmm._posterior_tiles[float32]"
    parts = [c for c in work.KERNELS[name].calls if c != "kernel"]
    calls = _kernel_calls(tmp_path, name, parts)
    (row,) = [r for r in table if r["kernel"] == name and r["dtype"] == "float32"]
    assert calls["instructions"] == row["body_pipes"]["total"]
    assert sum(p["total"] for p in calls["pipes"].values()) == calls["instructions"]
    work_loop = next(r for r in row["regions"] if r["depth"] == row["work_loop_depth"]
                     and r["instructions"] == row["work_loop"]["total"])
    assert calls["region_calls"][str(work_loop["start"])] == "kernel"
    pipes, t = calls["pipes"], gmm.tile_constants(gmm.GPU_GEOMETRY)
    assert pipes["stage_tail"]["fp32"] == work_loop["pipes"]["fp32"] == t["DC"] * t["RM"] * t["RK"] * 3
    assert pipes["absorb"]["mufu"] == t["RM"] * (t["RK"] + 1)
    # no branch per entry in a component tile's epilogue (the padding past K is -inf there): fewer control
    # instructions than the thread's RM x RK entries
    assert pipes["absorb"]["other"] < t["RM"] * t["RK"], pipes["absorb"]
    assert pipes["normalise"]["mufu"] == t["RM"] and pipes["log_normalise"]["mufu"] == 0
    assert all(p["total"] > 0 for p in pipes.values()), {n: p["total"] for n, p in pipes.items()}


def test_the_flash_attention_code_is_split_into_its_per_block_parts(table, tmp_path):
    """benchmarks/gpu_model.py counts the flash kernel's once-a-block code once a block (gpu.work's declaration): the
    split is the plain build's code and adds up to it; both declared products (q k^T, P V) are the kernel's own code,
    counted per key tile; the block's place and the packed search are integer code, q's staging loads and stores
    without arithmetic, the rows' results divide (the reciprocal's special function)."""
    from gpu import work

    name = "gpu.numba_cuda.attention._flash_forward[float32]"
    calls = _kernel_calls(tmp_path, name, [c for c in work.KERNELS[name].calls if c != "kernel"])
    (row,) = [r for r in table if r["kernel"] == name and r["dtype"] == "float32"]
    assert calls["instructions"] == row["body_pipes"]["total"]
    assert sum(p["total"] for p in calls["pipes"].values()) == calls["instructions"]
    products = [r for r in row["regions"] if r["flops"] and r["depth"] >= 2 and r["pipes"]["fp32"] >= 32]
    assert len(products) >= 2 and all(calls["region_calls"][str(r["start"])] == "kernel" for r in products)
    pipes = calls["pipes"]
    assert pipes["place"]["fp32"] == pipes["locate"]["fp32"] == pipes["stage_q"]["fp32"] == 0
    assert pipes["stage_q"]["mem"] > 0 and pipes["stage_q"]["shared"] > 0
    assert pipes["finish"]["mufu"] > 0 and pipes["finish"]["mem"] > 0
    assert all(p["total"] > 0 for p in pipes.values()), {n: p["total"] for n, p in pipes.items()}


def test_every_kernel_compiles_for_sm80_too(compiled):
    """The A100's PTX of every kernel and float type, written by NVVM from the IR lowered for sm_90."""
    sm80 = compiled["also"]["sm_80"]
    assert {n: sorted(t) for n, t in sm80.items()} == {n: sorted(t) for n, t in compiled["ptx"].items()}
    empty = [(n, t) for n, types in sm80.items() for t, length in types.items() if length == 0]
    assert not empty, f"no sm_80 PTX for {empty}"


def test_no_kernel_spills_registers(table):
    spilled = [f"{_short(r['kernel'])} {r['dtype']}: {r['spill_stores']} B stored, {r['spill_loads']} B loaded"
               for r in table if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "\n".join(spilled) + "\n" + format_table(table)


#: The float type the occupancy target is asserted in: the one ``bench_gpu.py`` measures and its targets are set for
#: (a float64 register tile needs twice the registers; its occupancy is printed, not asserted).
TARGET_DTYPE = "float32"


def test_roofline_kernels_reach_half_occupancy_at_their_block_size(table):
    mine = [r for r in table if r["role"] in sass.ROLES and r["dtype"] == TARGET_DTYPE]
    assert {r["role"] for r in mine} == set(sass.ROLES), "a role has no kernel"
    unregistered = sorted({_short(r["kernel"]) for r in mine if r["assumed"]})
    assert not unregistered, f"register the block size of these kernels (kernel(..., threads=...)): {unregistered}"
    low = [f"{_short(r['kernel'])} {r['dtype']}: {100 * r['occupancy']:.1f}% ({r['threads']} threads, "
           f"{r['registers']} registers, {r['shared']} B shared; bound by {r['limit']})"
           for r in mine if r["occupancy"] < MIN_OCCUPANCY]
    assert not low, "\n".join(low)


#: The kernels whose float64 build must reach :data:`MIN_OCCUPANCY` too (named as in :data:`MIN_FP_SHARES`): each has
#: a float64 geometry of its own (smaller register tiles), or register tiles small enough for doubles in both types
#: (dL/dx's 2 x 2), so that doubles fit in the registers of half occupancy.
FLOAT64_OCCUPANCY = ("responsibilities", "gpu.numba_cuda.scan._chunk_states", "gpu.numba_cuda.scan._chunk_rows",
                     "gpu.numba_cuda.gma._responsibility_rows")


@pytest.mark.parametrize("key", FLOAT64_OCCUPANCY)
def test_the_float64_builds_reach_half_occupancy_too(table, key):
    rows = [r for r in gated_kernels(table, key) if r["dtype"] == "float64"]
    assert rows, f"no float64 kernel {key}"
    low = [f"{_short(r['kernel'])}: {100 * r['occupancy']:.1f}% ({r['threads']} threads, {r['registers']} registers, "
           f"{r['shared']} B shared; bound by {r['limit']})" for r in rows if r["occupancy"] < MIN_OCCUPANCY]
    assert not low, "\n".join(low)


def responsibilities_kernels(rows):
    """The rows of the responsibilities kernel: tagged ``"responsibilities"``, else its role's kernel named for it."""
    tagged = [r for r in rows if "responsibilities" in r["tags"]]
    if tagged:
        return tagged
    return [r for r in rows if r["role"] == "responsibilities"
            and re.search(r"posterior|responsibilit", r["kernel"].rsplit(".", 1)[-1])]


def gated_kernels(rows, key):
    """The rows of the kernels :data:`MIN_FP_SHARES` names by ``key``: a qualified name stands for every build of the
    function (``scan._chunk_rows[float32]`` and ``[float64]``, built per float type, or ``scan._chunk_rows``)."""
    if key == "responsibilities":
        return responsibilities_kernels(rows)
    return [r for r in rows if r["kernel"].split("[", 1)[0] == key]


@pytest.mark.parametrize("key", sorted(MIN_FP_SHARES))
def test_floating_point_share_of_the_work_loop(table, key):
    _tool_or_skip("cuobjdump")
    rows = [r for r in gated_kernels(table, key) if r["dtype"] == "float32"]
    assert rows, f"no kernel {key} (the responsibilities kernel: tag it kernel(..., tags=('responsibilities',)))"
    for r in rows:
        mix = r["work_loop"]
        share = mix["fp"] / mix["total"] if mix["total"] else 0.0
        assert r["loop"], f"{_short(r['kernel'])}: no loop found"
        assert share >= MIN_FP_SHARES[key], (
            f"{_short(r['kernel'])}: floating point is {100 * share:.1f}% of its work loop of {mix['total']} instructions "
            f"({mix}; depth {r['work_loop_depth']}, {r['work_loop_flops']} useful FLOPs)"
        )


#: Most SASS instructions per useful FLOP (:func:`gpu.sass.work_flops`) in the work loop, by kernel (named as in
#: :data:`MIN_FP_SHARES`) and float type: 3% or more above the most that any of :data:`MEASURED_WITH` gave
#: (:data:`MEASURED`), so that a gate holds across those releases and fails on a regression of a few percent, never on
#: a 1% change of schedule.  The responsibilities (4 useful FLOPs a (row, component, coordinate): sub, square, scale,
#: add): float32's 4 x 4 tile takes 48 fp and 3 LDS.128 a coordinate for 64 FLOPs (0.80), the staging on top (0.85);
#: float64's 2 x 2 tile 12 fp and 3 LDS.128 for 16 FLOPs, 0.94 a coordinate at best (1.09).  dL/dx of the GMA
#: backward: 2 x 2 register tiles over 16 components a stage, straight-line: per component 12 fp and one 64-bit and
#: one 128-bit shared load for 16 FLOPs in float32 (0.875), one more 128-bit load in float64 (0.94), the staging on
#: top (289 and 306 instructions for 256 FLOPs).  The parameter partials: 2 x 2 register tiles over 16 tokens a
#: stage, per token and entry 4 fp instructions for 7.5 useful FLOPs (0.53), with the shared loads of c and x (401 or
#: 402 and 380 instructions for 480 FLOPs; one entry a thread took 11 instructions per token and entry).
MAX_INSTRUCTIONS_PER_FLOP = {"responsibilities": {"float32": 0.88, "float64": 1.13},
                             "gpu.numba_cuda.gma._responsibility_rows": {"float32": 1.17, "float64": 1.235},
                             "gpu.numba_cuda.gma._parameter_partials": {"float32": 0.865, "float64": 0.82}}

#: The ptxas releases the gates were measured with: every release from 13.0 to 13.5 (13.0.88, 13.1.115, 13.2.86,
#: 13.3.73, 13.4.92, 13.5.37) on the PTX of NVVM 13.0, and 13.5 on that of NVVM 13.5 (NVVM and ptxas 13.0 are the GPU
#: machines' toolkit; ``make gpu-rehearsal`` runs the gates with 13.0 and 13.5).  Another release of ptxas may
#: schedule otherwise: the count gates are then not asserted, and their skip says so.
MEASURED_WITH = ("13.0", "13.5")
#: The work loop's instructions and useful FLOPs that :data:`MEASURED_WITH` gave, by kernel and float type (the
#: largest count of the releases; they differ in the partials' float32 loop only: 402 with ptxas 13.0 to 13.2, 401
#: with 13.3 to 13.5).
MEASURED = {"responsibilities": {"float32": (435, 512), "float64": (140, 128)},
            "gpu.numba_cuda.gma._responsibility_rows": {"float32": (289, 256), "float64": (306, 256)},
            "gpu.numba_cuda.gma._parameter_partials": {"float32": (402, 480), "float64": (380, 480)}}
#: The least margin of a cap over the measured count.
MIN_MARGIN = 0.03


def _measured_ptxas_or_skip():
    """The release of the ptxas the tests use, or a skip that says the count gates were measured with others."""
    release = sass.tool_version("ptxas")
    if release is None or not (_release(MEASURED_WITH[0]) <= _release(release) <= _release(MEASURED_WITH[-1])):
        pytest.skip(f"the instruction-count gates were measured with ptxas {MEASURED_WITH[0]} to {MEASURED_WITH[-1]}; "
                    f"this is ptxas {release}: they are not asserted with it")
    return release


def _release(text):
    return tuple(int(part) for part in text.split("."))


def test_every_count_gate_keeps_a_margin_over_what_was_measured():
    assert set(MEASURED) == set(MAX_INSTRUCTIONS_PER_FLOP)
    for key, caps in MAX_INSTRUCTIONS_PER_FLOP.items():
        for dt, cap in caps.items():
            total, useful = MEASURED[key][dt]
            assert cap >= (1 + MIN_MARGIN) * total / useful, (key, dt, cap, total / useful)
            # and tight enough to catch a regression of a tenth (the kernels each replaced were 1.4 to 2 times slower)
            assert cap <= 1.1 * total / useful, (key, dt, cap, total / useful)


@pytest.mark.parametrize("key", sorted(MAX_INSTRUCTIONS_PER_FLOP))
def test_instructions_per_useful_flop_of_the_work_loop(table, compiled, key):
    _tool_or_skip("cuobjdump")
    _measured_ptxas_or_skip()
    for dt, most in MAX_INSTRUCTIONS_PER_FLOP[key].items():
        rows = [r for r in gated_kernels(table, key) if r["dtype"] == dt]
        assert rows, f"no {dt} kernel {key}"
        for r in rows:
            if r["work_loop"] is None:  # the table disassembles float32 only: this build's code, here
                r = dict(r, **sass.analyse(compiled["ptx"][r["kernel"]][dt], r["threads"], sass=True))
            total, useful = r["work_loop"]["total"], r["work_loop_flops"]
            assert useful and total / useful <= most, (
                f"{_short(r['kernel'])} {dt}: {total} instructions for {useful} useful FLOPs in its work loop "
                f"({total / max(useful, 1):.3f} a FLOP, at most {most})")


# --- the gates on the declared work: FLOPs from the algorithm (gpu.work), compared with the compiled loop ---------

#: The gates of every compute kernel of :data:`gpu.work.KERNELS` (float32), each limit with its reason: the least
#: useful FLOPs (of the algorithm, :func:`gpu.work.declared`) per instruction the gated loop region issues, the least
#: fused multiply-adds per shared-memory wavefront (:func:`gpu.sass.shared_wavefronts`: an SM's shared memory serves
#: one a clock, its FMA pipes four warp instructions; below 4 the loop cannot keep the FMA pipes busy from shared
#: memory), and the least share of FADD/FMUL/FFMA in the region (:func:`gpu.sass.arithmetic`).  Each limit is what the
#: kernel's structure gives, a few percent below, so that a change of structure (a wasted tile, a scalar load where a
#: vector one was, index arithmetic in the loop) fails it.
GATES = {
    "gpu.numba_cuda.gmm._posterior_tiles[float32]": {
        "flops_per_instruction": (1.15, "per coordinate the 4 x 4 register tile is 48 (sub, mul, fma) and 3 LDS.128 "
                                        "for 64 FLOPs (1.25); a stage of 8 coordinates adds its staging: 512 / 435"),
        "ffma_per_wavefront": (1.2, "(sub, mul, fma) has one FFMA in three: 16 FFMA per 3 LDS.128 (12 wavefronts) "
                                    "a coordinate, 4 fp arithmetic instructions a wavefront; the stage's 6 STS on top"),
        "fp_share": (0.85, "the stage's steps are straight-line code: 384 fp arithmetic of 435"),
    },
    "gpu.numba_cuda.scan._chunk_states[float32]": {
        "flops_per_instruction": (0.6, "4 x 4 tiles of scalar loads: 128 FLOPs per 105 instructions, times the useful "
                                       "fraction 0.51: d_v + 1 = 65 columns take two 64-column tiles"),
        "ffma_per_wavefront": (2.0, "RM RN / (RM + RN) = 16 / 8 with scalar loads: the FMA pipes at half rate when "
                                    "shared memory bounds the loop (8 x 8 tiles would give 4, with 64 accumulators)"),
        "fp_share": (0.6, "64 FFMA, 32 LDS and the loop's control: 61%"),
    },
    "gpu.numba_cuda.scan._chunk_rows[float32]": {
        "flops_per_instruction": (0.63, "the carried state's product, as _chunk_states: 128 FLOPs per 99 "
                                        "instructions, times the useful fraction 0.51 (65 columns, two tiles)"),
        "ffma_per_wavefront": (2.0, "RM RN / (RM + RN) with scalar loads, as _chunk_states"),
        "fp_share": (0.63, "64 FFMA, 32 LDS and the loop's control: 65%"),
    },
    "gpu.numba_cuda.gma._responsibility_rows": {
        "flops_per_instruction": (0.86, "per component the 2 x 2 tile is 12 (sub, mul, fma), one LDS.64 and one "
                                        "LDS.128 for 16 FLOPs (1.14); a stage of 16 components adds its staging: "
                                        "256 / 289"),
        "ffma_per_wavefront": (0.6, "4 FFMA (and 8 FADD, FMUL) per 6 wavefronts a component; the stage's 6 STS"),
        "fp_share": (0.65, "192 fp arithmetic of 289"),
    },
    "gpu.numba_cuda.gma._parameter_partials": {
        "flops_per_instruction": (0.62, "7.5 FLOPs an entry and token in (sub, fma, fma, fma) from the differences "
                                        "for the algorithm's 4 (useful fraction 0.53), 480 per 401 instructions"),
        "ffma_per_wavefront": (2.8, "per token 12 FFMA per two LDS.64 (4 wavefronts); the stage's 4 STS on top"),
        "fp_share": (0.7, "288 fp arithmetic of 401"),
    },
    "gpu.numba_cuda.attention._flash_forward[float32]": {
        "flops_per_instruction": (1.45, "the 4 x 4 register tile, per coordinate 16 FFMA and two LDS.128 at constant "
                                        "offsets from two registers (flat 32-bit indices, 64-bit offsets): 128 FLOPs "
                                        "per 83 instructions for 4 coordinates"),
        "ffma_per_wavefront": (2.0, "RQ RK / (RQ + RK) = 16 / 8: the rows of q^T and k^T padded by 16 bytes keep a "
                                    "thread's 4 rows and 4 keys one 128-bit load each"),
        "fp_share": (0.75, "64 FFMA of 83 instructions"),
    },
    "gpu.numba_cuda.attention._flash_forward[float32] P V": {
        "flops_per_instruction": (1.2, "per key RQ GC = 8 FFMA, 4 scalar loads of the weights and one LDS.64 of the "
                                       "values: 64 FLOPs per 51 instructions for 4 keys"),
        "ffma_per_wavefront": (1.3, "8 FFMA per 6 wavefronts a key: the weights are read by rows of P, one key a "
                                    "load (stored by keys, their stores would meet 16-way bank conflicts)"),
        "fp_share": (0.6, "32 FFMA of 51 instructions"),
    },
    "gpu.numba_cuda.ovq._predict_kernel": {
        "flops_per_instruction": (1.45, "the 4 x 4 register tile, 2 LDS.128 per 16 FFMA a coordinate: 128 FLOPs per "
                                        "82 instructions, times the useful fraction 0.96 (masked key tiles of the "
                                        "chunk's diagonal)"),
        "ffma_per_wavefront": (2.0, "16 FFMA per 8 wavefronts (two LDS.128) a coordinate"),
        "fp_share": (0.75, "64 FFMA of 82 instructions"),
    },
    "gpu.numba_cuda.ovq._chunk_loop_kernel": {
        "flops_per_instruction": (1.45, "the predict kernel's items, inlined in the loop: its loop, 128 FLOPs per 82 "
                                        "instructions times the useful fraction 0.96"),
        "ffma_per_wavefront": (2.0, "16 FFMA per 8 wavefronts (two LDS.128) a coordinate, as the predict kernel"),
        "fp_share": (0.75, "64 FFMA of 82 instructions, as the predict kernel"),
    },
}


def test_shared_wavefronts_arithmetic_and_ffma_on_hand_worked_cases():
    code = [(0, "LDS.128", "R4, [R2+0x10]", ""), (0x10, "LDS.64", "R8, [R2]", ""), (0x20, "LDS", "R9, [R3]", ""),
            (0x30, "LDS.U8", "R10, [R3]", ""), (0x40, "STS", "[R5], R4", ""), (0x50, "LDG.E.128", "R4, desc[UR4][R6.64]", ""),
            (0x60, "FFMA", "R1, R2, R3, R1", ""), (0x70, "DFMA", "R2, R4, R6, R2", ""), (0x80, "FADD", "R1, R1, R2", ""),
            (0x90, "FMUL", "R1, R1, R2", ""), (0xA0, "FSETP.GT.AND", "P0, PT, R1, R2, PT", ""), (0xB0, "FMNMX", "R1, R1, R2, !PT", ""),
            (0xC0, "MUFU.EX2", "R1, R2", ""), (0xD0, "FSEL", "R1, R1, R2, P0", ""), (0xE0, "HFMA2.MMA", "R5, -RZ, RZ, 1.875, 0", "")]
    assert sass.shared_wavefronts(code) == 4 + 2 + 1 + 1 + 1  # LDG is not shared memory
    assert sass.arithmetic(code) == 4  # FFMA, DFMA, FADD, FMUL; not FSETP, FMNMX, MUFU, FSEL, HFMA2
    assert sass.ffma(code) == 2


def test_regions_list_each_loop_region_with_useful_flops_once():
    code = _epilogue_after_a_product({a: "FMUL R10, R10, R12" for a in range(0x80, 0x100, 0x10)})
    found = sass.regions(code)
    assert [(r["depth"], r["start"], r["instructions"], r["flops"]) for r in found] == [(3, 0x20, 5, 4), (2, 0x80, 12, 8)]
    assert found[0]["arithmetic"] == 3 and found[0]["ffma"] == 1 and found[0]["wavefronts"] == 1


def test_the_declared_work_counts_padding_and_wasted_tiles():
    from gpu import work

    for name in ("gpu.numba_cuda.gmm._posterior_tiles[float32]", "gpu.numba_cuda.gma._responsibility_rows"):
        w = work.KERNELS[name]
        aligned = dict(w.case, N=4096, K=256, d=64)
        assert w.computed(aligned) == w.flops(aligned)  # whole tiles and stages: every executed FLOP is useful
        odd = dict(aligned, K=257)  # one more component: a whole tile more
        assert w.flops(odd) < w.computed(odd) and w.computed(odd) == w.computed(dict(aligned, K=256 + 64 if "gmm" in name else 256 + 16))
    states = work.KERNELS["gpu.numba_cuda.scan._chunk_states[float32]"]
    assert states.computed(dict(states.case, E=64)) == states.flops(dict(states.case, E=64))
    assert states.computed(states.case) == states.computed(dict(states.case, E=128))  # 65 columns cost two tiles
    for key in ("gpu.numba_cuda.attention._flash_forward[float32]", "gpu.numba_cuda.attention._flash_forward[float32] P V"):
        flash = work.KERNELS[key]
        assert flash.computed(flash.case) == flash.flops(flash.case)
        causal = dict(flash.case, N=4096, causal=True)  # the tiles on the diagonal are computed whole
        assert 1 < flash.computed(causal) / (causal["N"] * (causal["N"] + 1) * causal["d"]) < 1.02
    assert work.declared("gpu.numba_cuda.gma._parameter_partials")["useful_fraction"] == 4 / 7.5


def _gate_rows(table, compiled):
    """``{key of gpu.work.KERNELS: gpu.work.gate_metrics(...)}`` from the float32 rows of the table."""
    from gpu import work

    rows = {r["kernel"]: r for r in table if r["dtype"] == "float32"}
    return {key: work.gate_metrics(rows[work.declared(key)["kernel"]], key) for key in work.KERNELS}


def format_gates(metrics):
    """The gate table as text: per declared kernel (and region), the useful fraction, the useful FLOPs per issued
    instruction, FFMA per wavefront, the fp share and the region's length and depth."""
    lines = [f"{'kernel (region)':44s} {'useful':>6s} {'FLOP/instr':>10s} {'FFMA/wf':>7s} {'fp':>5s} {'instr':>5s} "
             f"{'depth':>5s}"]
    for key, m in metrics.items():
        r = m["region"]
        lines.append(f"{_short(key):44s} {m['useful_fraction']:6.3f} {m['flops_per_instruction']:10.3f} "
                     f"{m['ffma_per_wavefront']:7.2f} {100 * m['fp_share']:4.0f}% {r['instructions']:5d} {r['depth']:5d}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def gates(table, compiled, request):
    _tool_or_skip("cuobjdump")
    metrics = _gate_rows(table, compiled)
    missing = [k for k, m in metrics.items() if m is None]
    assert not missing, f"no loop region of the declared depth with useful FLOPs: {missing}"
    text = "gates on the declared work (gpu.work), float32 sm_90\n" + format_gates(metrics)
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        (cache.mkdir("gpu-ptx") / "gates-sm90.txt").write_text(text + "\n")
    return metrics


def test_every_declared_kernel_has_its_gates():
    from gpu import work

    assert set(GATES) == set(work.KERNELS)
    assert all(set(g) == {"flops_per_instruction", "ffma_per_wavefront", "fp_share"} for g in GATES.values())


def test_the_gated_region_is_the_declared_one(gates):
    # the compiled region holds a whole number of the declared source steps (one per unrolled copy): a region of
    # other work (an epilogue, a staging loop) or a wrong declaration does not
    wrong = {k: m["steps"] for k, m in gates.items() if m["steps"] < 1 or m["steps"] != int(m["steps"])}
    assert not wrong, f"regions whose useful FLOPs are not whole steps of the declared work: {wrong}"


@pytest.mark.parametrize("key", sorted(GATES))
def test_the_gates_of_the_declared_work(gates, key):
    m = gates[key]
    failed = [f"{metric} {m[metric]:.3f} < {limit} ({why})" for metric, (limit, why) in GATES[key].items()
              if m[metric] < limit]
    assert not failed, f"{_short(key)}: " + "; ".join(failed) + "\n" + format_gates(gates)
