"""gpu.sass: what the compiled Numba-CUDA kernels use, read from the compiler's outputs, without a GPU.

The PTX of every kernel (``gpu.numba_cuda._device.compile_all``) is
assembled for a real GPU by ``ptxas`` and disassembled by ``cuobjdump``, the
tools of the ``nvidia-cuda-nvcc`` and ``nvidia-cuda-cuobjdump`` wheels.  Three
facts come out of them, each a plain function on text:

* the resources of each kernel (:func:`parse_ptxas_info`, from ``ptxas -v``):
  registers per thread, bytes of spill stores and loads, static shared memory;
* its theoretical occupancy (:func:`occupancy`), from those resources and
  the block size it is launched with, by the rules of compute capability 9.0
  (H100, H200): 65,536 registers per multiprocessor allocated per warp in
  units of 256, at most 64 resident warps and 32 resident blocks, 228 KB of
  shared memory with 1 KB reserved for each block;
* the instruction mix of its loops (:func:`mix`, from ``cuobjdump -sass``),
  their instructions sorted into floating point, integer, memory and
  control/other (:func:`classify`): of the *hot loop* (:func:`hot_loop`), the
  largest loop region, and of the *work loop* (:func:`work_loop`), the loop
  region where the kernel's work is done: the one nested in the most loops
  among those that do useful arithmetic (:func:`work_flops`: floating-point
  arithmetic on registers alone, so not the constants of an ``exp``'s
  polynomial).  The work loop is what the floating-point share is gated on
  and what ``benchmarks/gpu_model.py`` paces a kernel by;
* which source line of the kernel each instruction comes from
  (:func:`parse_line_info`, from ``nvdisasm -g`` on code assembled with
  ``-lineinfo``), so that the code a device function inlines at its call can
  be told apart from the rest (:func:`call_pipes`: the model counts each
  call's code by how often that call runs);
* what the gates and the model read of a loop region: its FADD/FMUL/FFMA
  (:func:`arithmetic`, :func:`ffma`), its shared-memory wavefronts
  (:func:`shared_wavefronts`: a 128-bit access is four, one per quarter
  warp), every region with useful work (:func:`regions`) and the issue
  classes of its instructions by pipe (:func:`pipes`).

These are static facts about the code: the occupancy is what the resources
allow, not what a launch achieves, and the instruction mix counts
instructions in the loop body once each, not as executed.  Nothing here
needs or measures a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = [
    "SM90",
    "find_tool",
    "tool_version",
    "parse_ptxas_info",
    "parse_link_info",
    "link_device_runtime",
    "occupancy",
    "parse_sass",
    "parse_line_info",
    "call_lines",
    "call_pipes",
    "classify",
    "loops",
    "basic_blocks",
    "hot_loop",
    "work_loop",
    "mix",
    "flops",
    "work_flops",
    "arithmetic",
    "ffma",
    "shared_wavefronts",
    "regions",
    "pipes",
    "kernel_body",
    "loop_depth",
    "assemble",
    "analyse",
    "compile_kernels",
    "kernel_rows",
    "ROLES",
    "role",
]

#: The limits of compute capability 9.0 that bound residency on one multiprocessor.
SM90 = {
    "registers": 65536,  # 32-bit registers per multiprocessor
    "register_unit": 256,  # registers are allocated per warp, in units of this many
    "max_registers_per_thread": 255,
    "warps": 64,  # resident warps per multiprocessor
    "blocks": 32,  # resident blocks per multiprocessor
    "shared": 228 * 1024,  # shared memory per multiprocessor, bytes
    "shared_reserved": 1024,  # bytes the system keeps for each resident block
    "shared_unit": 128,  # shared memory is allocated in units of this many bytes
    "warp_size": 32,
}

#: Where each tool lives in the CUDA wheels, by package: CUDA 13 puts every tool in ``nvidia/cu13/bin``, CUDA 12
#: one package per tool.
_TOOL_HOMES = {
    "ptxas": ("nvidia.cu13", "nvidia.cuda_nvcc"),
    "cuobjdump": ("nvidia.cu13", "nvidia.cuda_cuobjdump"),
    "nvdisasm": ("nvidia.cu13", "nvidia.cuda_nvdisasm"),
}

#: The wheel that brings each tool, for the message of a missing one.
TOOL_WHEELS = {"ptxas": "nvidia-cuda-nvcc", "cuobjdump": "nvidia-cuda-cuobjdump", "nvdisasm": "nvidia-cuda-nvdisasm"}


def find_tool(name: str):
    """The path of the CUDA tool ``name`` (``"ptxas"``, ``"cuobjdump"``) from the CUDA wheels, or ``None``.

    The wheels' package folders are looked up with :mod:`importlib` (the
    ``bin`` folder beside the package), then ``PATH``.
    """
    exe = name + (".exe" if os.name == "nt" else "")
    for package in _TOOL_HOMES.get(name, ()):
        try:
            found = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if found is None:
            continue
        for folder in found.submodule_search_locations or ():
            path = Path(folder) / "bin" / exe
            if path.is_file() and os.access(path, os.X_OK):
                return path
    found = shutil.which(exe)
    return Path(found) if found else None


def tool_version(name: str):
    """The CUDA release of the tool ``name`` that :func:`find_tool` finds (``"13.0"``), from its ``--version``; None
    without the tool or a release in its output."""
    path = find_tool(name)
    if path is None:
        return None
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+\.\d+)", out)
    return found.group(1) if found else None


#: The roles whose kernels carry the roofline targets, and the module of :mod:`gpu.numba_cuda` that holds each
#: role's kernels when they carry no tag.
ROLES = {"responsibilities": ("gmm",), "gma": ("gma", "scan"), "attention": ("attention",)}


def role(name: str, tags=()) -> str | None:
    """The role of a registered kernel: its first tag that is a role of :data:`ROLES`, else its module's, else ``None``.

    ``name`` is the qualified name (``"gpu.numba_cuda.gmm._posterior_rows"``).
    """
    for tag in sorted(tags):
        if tag in ROLES:
            return tag
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    for r, modules in ROLES.items():
        if module in modules:
            return r
    return None


# --- ptxas -v ------------------------------------------------------------------------------------------------

_FUNCTION = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas_info(text: str) -> dict:
    """The resources of each entry function in the output of ``ptxas -v``.

    Parameters
    ----------
    text : str
        What ``ptxas -v`` writes (to stderr).

    Returns
    -------
    dict
        ``{entry name: {"registers", "spill_stores", "spill_loads", "stack",
        "shared"}}``, integers, bytes but for the registers (per thread);
        ``"shared"`` is the static shared memory.  Device functions that are
        not inlined (``.func``) have properties but no entry: their frames are
        not counted in any entry.
    """
    out, entry, current = {}, None, None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            entry = m.group(1)
            out[entry] = {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "shared": 0}
            continue
        m = _PROPERTIES.search(line)
        if m:
            current = m.group(1)
            continue
        m = _FRAME.search(line)
        if m and current is not None and current == entry:
            out[entry].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            continue
        m = _USED.search(line)
        if m and entry is not None:
            out[entry]["registers"] = int(m.group(1))
            s = _SMEM.search(line)
            out[entry]["shared"] = int(s.group(1)) if s else 0
    return out


# --- occupancy -----------------------------------------------------------------------------------------------


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(threads: int, registers: int, shared: int = 0, limits: dict = SM90) -> dict:
    """Theoretical occupancy of a kernel: resident warps per multiprocessor over the most it can hold.

    Parameters
    ----------
    threads : int
        Threads per block (1 to 1024).
    registers : int
        Registers per thread (``ptxas -v``).
    shared : int
        Static plus dynamic shared memory per block, bytes.
    limits : dict
        The multiprocessor's limits (default :data:`SM90`).

    Returns
    -------
    dict
        ``blocks`` resident blocks, ``warps`` resident warps, ``fraction``
        (``warps`` over the most warps), and ``limit``, what bounds the blocks
        (``"warps"``, ``"blocks"``, ``"registers"``, ``"shared"``; the first of
        them when several give the same bound).
    """
    if not 1 <= threads <= 1024:
        raise ValueError(f"threads per block must be in [1, 1024], got {threads}")
    warps = -(-threads // limits["warp_size"])
    bounds = {"warps": limits["warps"] // warps, "blocks": limits["blocks"]}
    if registers > 0:
        # registers are allocated per warp, in whole units: a warp of r-register threads holds ceil(32 r / 256) * 256
        per_warp = _round_up(registers * limits["warp_size"], limits["register_unit"])
        bounds["registers"] = (limits["registers"] // per_warp) // warps
    per_block = _round_up(shared, limits["shared_unit"]) + limits["shared_reserved"]
    bounds["shared"] = limits["shared"] // per_block
    limit = min(bounds, key=bounds.get)
    blocks = bounds[limit]
    return {"blocks": blocks, "warps": blocks * warps, "fraction": blocks * warps / limits["warps"], "limit": limit}


# --- cuobjdump -sass ----------------------------------------------------------------------------------------

_SASS_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_SASS_LINE = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s+(.*?)\s*;")
_BRANCH_TARGET = re.compile(r"0x([0-9a-fA-F]+)")


def _by_function(text: str, header):
    """``(function name, line)`` for each line of ``text`` after the first line that ``header`` matches, the name
    being its first group in the last such line (the header lines themselves as ``(name, None)``)."""
    current = None
    for line in text.splitlines():
        m = header.match(line)
        if m:
            current = m.group(1)
            yield current, None
        elif current is not None:
            yield current, line


def parse_sass(text: str) -> dict:
    """The instructions of each function in the output of ``cuobjdump -sass``.

    Returns
    -------
    dict
        ``{function name: [(address, opcode, operands, predicate), ...]}``
        in address order: ``opcode`` with its modifiers (``"FFMA.FTZ"``),
        ``operands`` the rest of the line (``""`` when none), ``predicate``
        the guard (``"@!P0"``) or ``""``.
    """
    out = {}
    for name, line in _by_function(text, _SASS_FUNCTION):
        current = out.setdefault(name, [])
        m = None if line is None else _SASS_LINE.match(line)
        if m is None:
            continue
        body = m.group(2).split()
        if not body:
            continue
        predicate = body.pop(0) if body[0].startswith("@") else ""
        if not body:
            continue
        current.append((int(m.group(1), 16), body[0], " ".join(body[1:]), predicate))
    return out


_NVDISASM_SECTION = re.compile(r"^\s*\.text\.(\S+?):\s*$")
_NVDISASM_LINE = re.compile(r'^\s*//## File "[^"]*", line (\d+)')
_INLINED_AT = re.compile(r'inlined at "[^"]*", line (\d+)')


def parse_line_info(text: str) -> dict:
    """The source line of each instruction in the output of ``nvdisasm -g``.

    Returns
    -------
    dict
        ``{function name: {address: line}}``: an instruction takes the line
        of the last ``//## File ..., line N`` before it in its function (none
        before it: not in the result), the outermost ``inlined at`` line
        when there is one.  The addresses are those of :func:`parse_sass` on
        the same cubin.
    """
    out, line = {}, None
    for name, text_line in _by_function(text, _NVDISASM_SECTION):
        current = out.setdefault(name, {})
        if text_line is None:  # a function's header: it starts with no line
            line = None
            continue
        m = _NVDISASM_LINE.match(text_line)
        if m:
            # the outermost place: the line of the function disassembled (code inlined into it names its call there)
            line = int((_INLINED_AT.findall(text_line) or [m.group(1)])[-1])
            continue
        m = _SASS_LINE.match(text_line)
        if m and line is not None:
            current[int(m.group(1), 16)] = line
    return out


def call_lines(fn, calls) -> dict:
    """``{name: set of source lines}`` of each call in ``fn``'s body to a function named in ``calls`` (each line of
    the call's statement, its arguments included), from the source of ``fn`` (a plain or a Numba function)."""
    import ast
    import inspect
    import textwrap

    fn = getattr(fn, "py_func", fn)
    source, first = inspect.getsourcelines(fn)
    out = {name: set() for name in calls}
    for node in ast.walk(ast.parse(textwrap.dedent("".join(source)))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in out:
            out[node.func.id].update(range(first + node.lineno - 1, first + node.end_lineno))
    return out


def call_pipes(instructions, lines: dict, calls: dict) -> dict:
    """The :func:`pipes` of the code each call inlines into a kernel, and of the rest.

    ``instructions``: the kernel's (:func:`kernel_body`); ``lines``: its
    address to source line map (:func:`parse_line_info`); ``calls``: the
    lines of each call (:func:`call_lines`).  Returns ``{"pipes": {name:
    pipes, ..., "kernel": pipes of every other instruction}, "of": {address:
    name}}``.
    """
    owner = {line: name for name, owned in calls.items() for line in owned}
    parts = {name: [] for name in [*calls, "kernel"]}
    of = {}
    for ins in instructions:
        name = owner.get(lines.get(ins[0]), "kernel")
        parts[name].append(ins)
        of[ins[0]] = name
    return {"pipes": {name: pipes(code) for name, code in parts.items()}, "of": of}


#: Opcodes (without modifiers) of each class; an opcode of none of them is control/other.
_FP = frozenset({
    "FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "FSET", "FCHK", "FRND", "FSWZADD", "MUFU",
    "DFMA", "DADD", "DMUL", "DMNMX", "DSETP", "DSET",
    "HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2",
    "FFMA32I", "FADD32I", "FMUL32I",
})
_INT = frozenset({
    "IMAD", "IMUL", "IADD", "IADD3", "IADD32I", "IMAD32I", "IMUL32I", "IABS", "IMNMX", "ISETP", "ISET", "ICMP",
    "LEA", "LOP", "LOP3", "LOP32I", "SHF", "SHL", "SHR", "SEL", "PRMT", "POPC", "FLO", "BREV", "BMSK", "SGXT",
    "IDP", "IDP4A", "VIADD", "VIADDMNMX", "VIMNMX", "VIMNMX3", "XMAD", "ISCADD", "BFE", "BFI",
    "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "UISETP", "USEL", "UPRMT", "UFLO", "UPOPC", "UBREV", "USGXT",
    "UBMSK", "UIMNMX", "ULOP", "ULOP32I",
})
_MEM = frozenset({
    "LDG", "STG", "LDS", "STS", "LDL", "STL", "LD", "ST", "LDC", "ULDC", "LDSM", "STSM", "LDGSTS", "LDGDEPBAR",
    "ATOM", "ATOMS", "ATOMG", "RED", "REDG", "LDTRAM", "TLD", "TEX", "SULD", "SUST", "UBLKCP", "UTMALDG",
    "UTMASTG", "LDCU",
})

CLASSES = ("fp", "int", "mem", "other")


def classify(opcode: str) -> str:
    """``"fp"``, ``"int"``, ``"mem"`` or ``"other"`` for a SASS opcode, modifiers ignored (``"FFMA.FTZ"`` is fp).

    Floating point: arithmetic, comparisons, selections and the special
    function unit (``MUFU``) in half, single and double precision.  Integer:
    integer arithmetic, logic, shifts and comparisons, the uniform datapath's
    too (``UIADD3``).  Memory: loads, stores and atomics of every space,
    constants (``LDC``) included.  Everything else (moves, conversions,
    special registers, predicates, barriers, branches) is control/other.
    """
    base = opcode.split(".", 1)[0].upper()
    if base in _FP:
        return "fp"
    if base in _INT:
        return "int"
    if base in _MEM:
        return "mem"
    return "other"


def _branch_target(opcode, operands):
    if opcode.split(".", 1)[0] not in ("BRA", "JMP"):
        return None
    m = _BRANCH_TARGET.search(operands)
    return int(m.group(1), 16) if m else None


def loops(instructions) -> list:
    """The loops of a function: ``(start address, end address)`` of every backward branch, innermost first.

    A branch to an address before its own (not to itself: the final
    ``BRA`` that parks a thread after ``EXIT``) closes a loop whose body runs
    from the target to the branch.  Only the kernel's own code counts: what
    follows its last ``EXIT`` is the routines it calls (``CALL.REL``: integer
    division, the slow path of a float division), whose loops are left out.
    Sorted by nesting (the loops with fewest loops inside them first), then
    by address.
    """
    exits = [address for address, opcode, _, _ in instructions if opcode.split(".", 1)[0] == "EXIT"]
    end = max(exits) if exits else float("inf")
    found = set()
    for address, opcode, operands, _ in instructions:
        target = _branch_target(opcode, operands)
        if target is not None and target < address <= end:
            found.add((target, address))

    def contains(outer, inner):
        return outer != inner and outer[0] <= inner[0] and inner[1] <= outer[1]

    depth = {lp: sum(contains(lp, other) for other in found) for lp in found}  # loops inside it
    return sorted(found, key=lambda lp: (depth[lp], lp[0]))


#: Opcodes after which a basic block ends (the next instruction starts one).
_BLOCK_ENDS = frozenset({"BRA", "BRX", "JMP", "JMX", "EXIT", "RET", "BREAK", "KILL"})


def basic_blocks(instructions) -> list:
    """The basic blocks of a function: lists of consecutive instructions entered only at their first one.

    A block starts at the function's first instruction, at every branch
    target and after every branch, ``EXIT`` or ``RET`` (guarded or not).
    """
    targets = {t for _, opcode, operands, _ in instructions if (t := _branch_target(opcode, operands)) is not None}
    out, current = [], []
    for ins in instructions:
        if current and ins[0] in targets:
            out.append(current)
            current = []
        current.append(ins)
        if ins[1].split(".", 1)[0] in _BLOCK_ENDS:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def hot_loop(instructions) -> list:
    """The instructions of the hot loop: the largest innermost loop body, or the largest basic block in a loop.

    Innermost: a loop with no loop inside it (:func:`loops`).  When a loop's
    work is unrolled into straight-line code (its trip count is a compile-time
    constant), the innermost loops left may be small ones (staging a tile, a
    remainder); the unrolled work is then a basic block of an enclosing loop
    (:func:`basic_blocks`), larger than them, and that block is the hot loop.
    An empty list when the function has no loop.  A call (``CALL.REL``, say
    an integer division) counts as one instruction: the routine it calls is
    not counted.  The hot loop is where the most instructions are, not always
    where the kernel's work is (:func:`work_loop`).
    """
    candidates = _loop_regions(instructions)
    return max(candidates, key=len) if candidates else []


def _loop_regions(instructions) -> list:
    """The innermost loop bodies and the basic blocks inside a loop (the candidates of :func:`hot_loop`)."""
    found = loops(instructions)
    inner = [lp for lp in found if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in found)]
    candidates = [[ins for ins in instructions if lp[0] <= ins[0] <= lp[1]] for lp in inner]
    candidates += [b for b in basic_blocks(instructions) if any(lp[0] <= b[0][0] and b[-1][0] <= lp[1] for lp in found)]
    return candidates


def loop_depth(region, instructions) -> int:
    """The number of loops of ``instructions`` (:func:`loops`) whose body holds all of ``region`` (a list of them).

    An innermost loop's body is inside its own loop: its depth is 1 plus the
    loops around it; a basic block of an outer loop's body counts that loop
    and those around it.  0 for a region in no loop.
    """
    return _depth(region, loops(instructions))


def _depth(region, found) -> int:
    if not region:
        return 0
    first, last = region[0][0], region[-1][0]
    return sum(start <= first and last <= end for start, end in found)


def work_loop(instructions) -> list:
    """The loop region where the kernel's work is done: of those with useful FLOPs, the one nested in the most loops.

    The candidates are :func:`hot_loop`'s (the innermost loop bodies and the
    basic blocks inside a loop).  Of those that do useful work
    (:func:`work_flops` above zero), the work loop is the one with the
    greatest :func:`loop_depth`; ties go to the most useful FLOPs, then to
    the longest (a whole loop body before one of its blocks).  When no
    candidate does useful work, it is the hot loop.  An empty list without
    a loop.

    Why the depth first: a region runs once per iteration of every loop
    around it, so, in a tiled kernel, the deepest region runs the most
    times: the product over the coordinates, inside the loop over the
    coordinate chunks, inside the loop over the tiles, runs ``d`` times for
    each time the tile's epilogue (the combine tree of a log-sum-exp, the
    rescaling of an online softmax) runs once.  The listing gives no trip
    counts, and the epilogue, unrolled and full of ``exp``, can hold more
    instructions and more raw FLOPs (:func:`flops`) than the loop it
    follows: a rule on size or FLOPs alone picks it.  Only useful FLOPs
    qualify a region, so that a deep loop of index arithmetic or of staging
    copies does not.  What the rule assumes: the loops around the work run
    more than once each, and no deeper loop does a little arithmetic beside
    larger work in shallower, unrolled code (a deeper loop with one useful
    FLOP wins over it).
    """
    candidates = _loop_regions(instructions)
    if not candidates:
        return []
    useful = [(c, w) for c in candidates if (w := work_flops(c)) > 0]
    if not useful:
        return hot_loop(instructions)
    found = loops(instructions)
    return max(useful, key=lambda cw: (_depth(cw[0], found), cw[1], len(cw[0])))[0]


def mix(instructions) -> dict:
    """``{class: count}`` over :data:`CLASSES`, plus ``"total"``, for a list of instructions (:func:`parse_sass`)."""
    counts = dict.fromkeys(CLASSES, 0)
    for _, opcode, _, _ in instructions:
        counts[classify(opcode)] += 1
    counts["total"] = len(instructions)
    return counts


#: Floating-point operations per thread of each arithmetic opcode (a fused multiply-add counts two; the paired half
#: precision ones, four); comparisons, selections and the special function unit count none.
FLOPS = {"FFMA": 2, "FADD": 1, "FMUL": 1, "DFMA": 2, "DADD": 1, "DMUL": 1, "HFMA2": 4, "HADD2": 2, "HMUL2": 2,
         "FFMA32I": 2, "FADD32I": 1, "FMUL32I": 1}


def flops(instructions) -> int:
    """Floating-point operations per thread of a list of instructions, by :data:`FLOPS`."""
    return sum(FLOPS.get(opcode.split(".", 1)[0].upper(), 0) for _, opcode, _, _ in instructions)


#: Modifiers of an arithmetic opcode that mark it as part of an expansion (of ``exp``, a division, a conversion),
#: not of the algorithm's arithmetic: saturation, and rounding other than to nearest.
_EXPANSION_MODIFIERS = frozenset({"SAT", "RM", "RP", "RZ"})
_REGISTER = re.compile(r"^U?R\d+$")


def _register_operand(operand: str) -> bool:
    # "-|R4|.reuse" is register R4 (negated, absolute value, kept in the reuse cache); RZ, URZ, immediates
    # ("1.4426950216293334961", "0x3f800000", "-12583039", "+INF") and constant banks ("c[0x0][0x210]") are not
    core = operand.strip().lstrip("-").strip("|").split(".", 1)[0].strip("|")
    return bool(_REGISTER.match(core))


def work_flops(instructions) -> int:
    """The useful floating-point operations per thread of a list of instructions: the kernel's work in it.

    The :data:`FLOPS` of the arithmetic instructions whose source operands
    are all registers (``R``, ``UR``; not ``RZ``) and whose opcode carries no
    saturation or directed rounding (``.SAT``, ``.RM``, ``.RP``, ``.RZ``).
    What is left out is most of the code the compiler expands a function
    into, whose constants are immediates and whose rounding is directed: the
    range reduction and polynomial of a float32 ``exp`` (``FFMA.SAT R, R, R,
    0.5``, ``FFMA.RM R, R, R, 12582913``, ``FFMA R, R, 1.44269..., -R``).
    Every operand of the algorithm's own products and sums (``s += q_i k_j``,
    ``x - m``) is data, held in registers; its rounding is to nearest,
    unmarked.  Two limits: a product by a constant the source writes out
    (``0.5 * x``) is left out too (the rule cannot tell it from an
    expansion's), and an expansion whose constants sit in registers (a
    float64 ``exp`` loads its polynomial's coefficients into register pairs)
    counts; :func:`work_loop` ranks by depth first, so that such an
    epilogue is not taken for the work.
    """
    total = 0
    for _, opcode, operands, _ in instructions:
        base, *modifiers = opcode.upper().split(".")
        if base not in FLOPS or _EXPANSION_MODIFIERS.intersection(modifiers):
            continue
        sources = operands.split(",")[1:]
        if sources and all(_register_operand(o) for o in sources):
            total += FLOPS[base]
    return total


#: The floating-point arithmetic opcodes the FMA pipes run (float32 and float64 add, multiply, fused multiply-add, and
#: their forms with an immediate operand): the instructions of the fp share that the gates read.  Comparisons,
#: selections, minima and maxima (``FSETP``, ``FSEL``, ``FMNMX``) and the special function unit (``MUFU``) are not
#: arithmetic on the data: they are left out.
FP_ARITHMETIC = frozenset({"FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "DFMA", "DADD", "DMUL"})


def arithmetic(instructions) -> int:
    """The instructions of :data:`FP_ARITHMETIC` in a list of instructions (modifiers ignored)."""
    return sum(opcode.split(".", 1)[0].upper() in FP_ARITHMETIC for _, opcode, _, _ in instructions)


def ffma(instructions) -> int:
    """The fused multiply-adds (``FFMA``, ``FFMA32I``, ``DFMA``) in a list of instructions."""
    return sum(opcode.split(".", 1)[0].upper() in ("FFMA", "FFMA32I", "DFMA") for _, opcode, _, _ in instructions)


#: Shared-memory wavefronts of one warp's access, by the access's width in bits: the shared memory serves 128 bytes
#: a clock, so 32 lanes of 32 bits are one wavefront, of 64 bits two (a half warp each), of 128 bits four (a quarter
#: warp each).  Without bank conflicts; a broadcast counts as the access it is.
WAVEFRONTS = {8: 1, 16: 1, 32: 1, 64: 2, 128: 4}
_SHARED = frozenset({"LDS", "STS", "ATOMS"})


def shared_wavefronts(instructions) -> int:
    """The shared-memory wavefronts a warp issues for a list of instructions: :data:`WAVEFRONTS` of every ``LDS``,
    ``STS`` and ``ATOMS`` by its width (``LDS.128``: 4, ``LDS.64``: 2, ``LDS``, ``LDS.U8``: 1), without bank
    conflicts."""
    total = 0
    for _, opcode, _, _ in instructions:
        base, *modifiers = opcode.upper().split(".")
        if base in _SHARED:
            widths = [int(m) for m in modifiers if m.isdigit()]
            total += WAVEFRONTS.get(max(widths) if widths else 32, 1)
    return total


#: The issue classes of the pipes an sm_90 multiprocessor runs at different rates (:func:`pipes`): ``fp32`` the float32
#: add, multiply and fused multiply-add (and the paired half-precision ones), ``fp64`` their float64 forms, ``alu``
#: integer arithmetic and logic and the float comparisons, selections, minima and maxima, ``mufu`` the special
#: function unit, ``cvt`` conversions, ``shared`` shared-memory wavefronts (:func:`shared_wavefronts`), ``mem`` the
#: other memory instructions (global, local, constant), ``other`` the rest (moves, branches, barriers, special
#: registers), which take an issue slot and no pipe of their own.
PIPES = ("fp32", "fp64", "alu", "mufu", "cvt", "shared", "mem", "other")
_FP32 = frozenset({"FFMA", "FADD", "FMUL", "FFMA32I", "FADD32I", "FMUL32I", "HFMA2", "HADD2", "HMUL2"})
_FP64 = frozenset({"DFMA", "DADD", "DMUL", "DMNMX", "DSETP", "DSET"})
_CVT = frozenset({"F2F", "F2I", "I2F", "I2I", "F2FP", "FRND", "I2FP", "F2IP"})


def pipes(instructions) -> dict:
    """``{class of :data:`PIPES`: count, "total": instructions}`` for a list of instructions; ``shared`` counts
    wavefronts (:func:`shared_wavefronts`), not instructions."""
    out = dict.fromkeys(PIPES, 0)
    for _, opcode, _, _ in instructions:
        base = opcode.split(".", 1)[0].upper()
        if base in _FP32:
            out["fp32"] += 1
        elif base in _FP64:
            out["fp64"] += 1
        elif base == "MUFU":
            out["mufu"] += 1
        elif base in _CVT:
            out["cvt"] += 1
        elif base in _SHARED:
            pass  # counted in wavefronts below
        elif classify(opcode) in ("fp", "int"):
            out["alu"] += 1
        elif classify(opcode) == "mem":
            out["mem"] += 1
        else:
            out["other"] += 1
    out["shared"] = shared_wavefronts(instructions)
    out["total"] = len(instructions)
    return out


def kernel_body(instructions) -> list:
    """The kernel's own instructions: up to its last ``EXIT`` (the routines it calls follow it)."""
    exits = [i for i, ins in enumerate(instructions) if ins[1].split(".", 1)[0] == "EXIT"]
    return instructions[: exits[-1] + 1] if exits else list(instructions)


def regions(instructions) -> list:
    """Every loop region of :func:`work_loop`'s candidates that does useful arithmetic, with what the gates read.

    ``[{"depth", "start", "instructions", "flops", "arithmetic", "ffma", "wavefronts", "pipes"}]``
    (:func:`loop_depth`, the first address, the length, :func:`work_flops`, :func:`arithmetic`, :func:`ffma`,
    :func:`shared_wavefronts`, :func:`pipes`), by depth (deepest first), then useful FLOPs (most first), then length.  A kernel's
    declared work (``gpu.work``) names the region it is done in by its depth when that is not the work loop's.
    """
    found = loops(instructions)
    out, seen = [], set()
    for c in _loop_regions(instructions):
        w = work_flops(c)
        if w > 0 and (c[0][0], len(c)) not in seen:  # an innermost loop's body can be one basic block too
            seen.add((c[0][0], len(c)))
            out.append({"depth": _depth(c, found), "start": c[0][0], "instructions": len(c), "flops": w,
                        "arithmetic": arithmetic(c), "ffma": ffma(c), "wavefronts": shared_wavefronts(c),
                        "pipes": pipes(c)})
    out.sort(key=lambda r: (-r["depth"], -r["flops"], -r["instructions"], r["start"]))
    return out


# --- the tools, run -----------------------------------------------------------------------------------------


def _tool(name, given=None):
    """``given``, else :func:`find_tool`'s ``name``; a missing tool raises, naming its wheel."""
    path = given or find_tool(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found: install the {TOOL_WHEELS[name]} wheel")
    return path


def _relocatable(ptx: str) -> list:
    """``["-c"]`` for a kernel that calls into the device runtime (a cooperative grid's barrier, in libcudadevrt): it
    is assembled as relocatable code, as the driver's linker takes it; ``[]`` for the others (whole programs)."""
    return ["-c"] if re.search(r"^\.extern \.func", ptx, re.MULTILINE) else []


def assemble(ptx: str, arch: str = "sm_90", sass: bool = True, ptxas=None, cuobjdump=None) -> dict:
    """Assemble one PTX module with ``ptxas -v`` and disassemble the cubin it writes.

    Parameters
    ----------
    ptx : str
        The PTX text of one module.
    arch : str
        The real architecture (``"sm_90"``).
    sass : bool
        Also disassemble (``cuobjdump -sass``); needs :func:`find_tool`'s ``cuobjdump``.

    Returns
    -------
    dict
        ``{"resources": parse_ptxas_info(...), "sass": parse_sass(...) or None}``.
    """
    ptxas = _tool("ptxas", ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        src.write_text(ptx)
        relocatable = _relocatable(ptx)
        proc = subprocess.run([str(ptxas), f"-arch={arch}", "-v", *relocatable, "-o", str(cubin), str(src)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            isa = re.search(r"^\s*\.version\s+(\S+)", ptx, re.MULTILINE)
            if isa and "Unsupported .version" in proc.stderr:  # NVVM newer than ptxas: say both, in one line
                raise RuntimeError(f"ptxas {Path(ptxas)} cannot assemble PTX ISA {isa.group(1)}, written by a newer NVVM: "
                                   f"use a ptxas of NVVM's CUDA release or later ({proc.stderr.strip().splitlines()[-1]})")
            raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")
        out = {"resources": parse_ptxas_info(proc.stderr + proc.stdout), "sass": None}
        if relocatable:
            # the PTX linked with the device runtime, as Numba-CUDA links it before the launch: the linker places the
            # module's shared arrays, which ptxas -c leaves out of the entry's count (the SASS read below is ptxas's
            # own, the kernel's code that the link only relocates)
            for entry, used in parse_link_info(link_device_runtime(ptx, arch)).items():
                if entry in out["resources"]:
                    out["resources"][entry]["shared"] = used
        if sass:
            cuobjdump = _tool("cuobjdump", cuobjdump)
            dis = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True)
            out["sass"] = parse_sass(dis.stdout)
    return out


def link_device_runtime(ptx: str, arch: str = "sm_90") -> str:
    """nvJitLink's info log of a PTX module linked with the device runtime (``libcudadevrt``); a failed link raises.

    No GPU and no driver are needed: nvJitLink (the ``nvidia-nvjitlink`` wheel,
    through ``cuda-bindings``) links for ``arch``; the library is the CUDA
    wheels' (``cuda.pathfinder``), where Numba-CUDA finds it too.
    """
    from cuda.bindings import nvjitlink
    from cuda.pathfinder import find_static_lib

    handle = nvjitlink.create(2, [f"-arch={arch}", "-verbose"])
    try:
        code = ptx.encode()
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.PTX, code, len(code), "kernel")
            nvjitlink.add_file(handle, nvjitlink.InputType.LIBRARY, find_static_lib("cudadevrt"))
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as err:
            raise RuntimeError(f"nvJitLink failed ({err}): {_link_log(nvjitlink, handle, 'error')[-2000:]}") from err
        return _link_log(nvjitlink, handle, "info")
    finally:
        nvjitlink.destroy(handle)


def _link_log(nvjitlink, handle, kind):
    size = getattr(nvjitlink, f"get_{kind}_log_size")(handle)
    text = bytearray(size)
    getattr(nvjitlink, f"get_{kind}_log")(handle, text)
    return text.decode(errors="replace").rstrip("\x00")


_LINK_FUNCTION = re.compile(r"Function properties for '?([\w$.]+)'?:?")
_LINK_USED = re.compile(r"used (\d+) registers.*?(\d+) bytes smem")


def parse_link_info(text: str) -> dict:
    """``{function: static shared bytes}`` from nvJitLink's verbose info log (``used N registers, ..., S bytes smem``)."""
    out, current = {}, None
    for line in text.splitlines():
        m = _LINK_FUNCTION.search(line)
        if m:
            current = m.group(1)
            continue
        m = _LINK_USED.search(line)
        if m and current is not None:
            out[current] = int(m.group(2))
            current = None
    return out


def analyse(ptx: str, threads: int, arch: str = "sm_90", sass: bool = True) -> dict:
    """One kernel's row: resources, occupancy at ``threads`` threads per block, loop mixes and instruction count.

    ``ptx`` must hold one entry function (the PTX of one kernel and one
    signature, as ``gpu.numba_cuda._device.compile_all`` gives it).
    Returns ``{"registers", "spill_stores", "spill_loads", "stack", "shared",
    "threads", "occupancy", "limit", "loop", "hot_loop", "hot_loop_flops",
    "work_loop", "work_loop_flops", "work_loop_depth", "instructions"}``:
    ``hot_loop`` is :func:`mix` of :func:`hot_loop`, or of the whole function
    when it has no loop (``loop`` is then False), and ``hot_loop_flops`` its
    :func:`flops`; ``work_loop`` is :func:`mix` of :func:`work_loop` (the
    whole function without a loop), ``work_loop_flops`` its useful FLOPs
    (:func:`work_flops`), ``work_loop_depth`` its :func:`loop_depth`,
    ``work_loop_arithmetic``, ``work_loop_ffma`` and ``work_loop_wavefronts``
    its :func:`arithmetic`, :func:`ffma` and :func:`shared_wavefronts`,
    ``work_loop_pipes`` its :func:`pipes`, ``regions`` every loop region
    with useful FLOPs (:func:`regions`) and ``body_pipes`` the :func:`pipes`
    of the whole kernel (:func:`kernel_body`);
    these are ``None`` without ``sass``, as is ``instructions``, the
    function's whole length.
    """
    res = assemble(ptx, arch=arch, sass=sass)
    if len(res["resources"]) != 1:
        raise ValueError(f"expected one entry function, found {len(res['resources'])}")
    (entry, row), = res["resources"].items()
    occ = occupancy(threads, row["registers"], row["shared"])
    row = dict(row, threads=threads, occupancy=occ["fraction"], limit=occ["limit"], loop=None, hot_loop=None,
               hot_loop_flops=None, work_loop=None, work_loop_flops=None, work_loop_depth=None, work_loop_arithmetic=None,
               work_loop_ffma=None, work_loop_wavefronts=None, work_loop_pipes=None, regions=None, body_pipes=None,
               instructions=None)
    if res["sass"] is not None:
        code = res["sass"].get(entry) or next(iter(res["sass"].values()))
        body = hot_loop(code)
        row["loop"] = bool(body)
        row["hot_loop"] = mix(body or code)
        row["hot_loop_flops"] = flops(body or code)
        work = work_loop(code)
        row["work_loop"] = mix(work or code)
        row["work_loop_flops"] = work_flops(work or code)
        row["work_loop_depth"] = loop_depth(work, code)
        row["work_loop_arithmetic"] = arithmetic(work or code)
        row["work_loop_ffma"] = ffma(work or code)
        row["work_loop_wavefronts"] = shared_wavefronts(work or code)
        row["work_loop_pipes"] = pipes(work or code)
        row["regions"] = regions(code)
        row["body_pipes"] = pipes(kernel_body(code))
        row["instructions"] = len(code)
    return row


def compile_kernels(cc=(9, 0), also=()) -> dict:
    """The PTX and launch facts of every kernel of :mod:`gpu.numba_cuda`, compiled for ``cc`` without a GPU.

    Call it in a process that imports numba with the real CUDA target
    (``NUMBA_ENABLE_CUDASIM=0`` before numba is first imported): every module
    of the package is imported, so every kernel is registered, and
    ``gpu.numba_cuda._device.compile_targets`` compiles them, each kernel
    lowered once for ``cc`` and the capabilities ``also`` too.

    Returns
    -------
    dict
        ``{"ptx": {name: {dtype name: PTX}}, "launch": {name: {dtype name:
        {"threads", "assumed", "tags"}}}, "also": {"sm_XY": {name: {dtype
        name: length of the PTX}}}}``, JSON-ready.
    """
    import importlib
    import pkgutil

    import gpu.numba_cuda as package
    from gpu.numba_cuda import _device

    for m in sorted(p.name for p in pkgutil.iter_modules(package.__path__)):
        importlib.import_module("gpu.numba_cuda." + m)
    targets = _device.compile_targets([tuple(cc), *(tuple(c) for c in also)])
    ptx = {}
    for (name, t), code in targets.pop(tuple(cc)).items():
        ptx.setdefault(name, {})[t] = code
    lengths = {}
    for other, codes in targets.items():
        for (name, t), code in codes.items():
            lengths.setdefault(f"sm_{other[0]}{other[1]}", {}).setdefault(name, {})[t] = len(code)
    launch = {}
    for name in ptx:
        launch[name] = {}
        for f in _device.DTYPES:
            threads, assumed, tags = _device.launch_info(name, f)
            launch[name][str(f)] = {"threads": threads, "assumed": assumed, "tags": sorted(tags)}
    return {"ptx": ptx, "launch": launch, "also": lengths}


def kernel_calls(name: str, calls, dtype: str = "float32", cc=(9, 0)) -> dict:
    """What :func:`call_pipes` says of the registered kernel ``name``: the code each device function of ``calls``
    inlines into it, and the rest, from a build with line information.

    Compiles the kernel for ``cc`` with ``lineinfo`` (a real CUDA target, as
    :func:`compile_kernels`), assembles it with ``ptxas -lineinfo`` and reads
    the SASS (``cuobjdump``) and each instruction's source line (``nvdisasm
    -g``).  Line information does not change the code (the instruction count
    is returned to check it against the plain build).

    Returns
    -------
    dict
        ``{"pipes": {name: pipes, ..., "kernel": pipes}, "region_calls":
        {start address: name} of every :func:`regions` entry, "instructions":
        the kernel body's length}``, JSON-ready.
    """
    import importlib

    from numba import cuda, float32, float64

    from gpu.numba_cuda import _device

    importlib.import_module(name.rsplit(".", 1)[0])
    fn, signature = _device.KERNELS[name]
    f = {"float32": float32, "float64": float64}[dtype]
    with _device._current_device_reports(tuple(cc)):
        ptx, _ = cuda.compile_ptx(fn, signature(f), cc=tuple(cc), lineinfo=True, **_device.compile_options(name, f))
    arch = f"sm_{cc[0]}{cc[1]}"
    tools = {t: _tool(t) for t in ("ptxas", "cuobjdump", "nvdisasm")}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        (Path(tmp) / "kernel.ptx").write_text(ptx)
        subprocess.run([str(tools["ptxas"]), f"-arch={arch}", "-lineinfo", *_relocatable(ptx), "-o", str(cubin),
                        str(Path(tmp) / "kernel.ptx")],
                       capture_output=True, text=True, check=True)
        code = parse_sass(subprocess.run([str(tools["cuobjdump"]), "-sass", str(cubin)], capture_output=True, text=True,
                                         check=True).stdout)
        lines = parse_line_info(subprocess.run([str(tools["nvdisasm"]), "-g", "-c", str(cubin)], capture_output=True,
                                               text=True, check=True).stdout)
    entry = re.search(r"^\.visible \.entry (\S+?)\(", ptx, re.MULTILINE).group(1)
    body = kernel_body(code[entry])
    split = call_pipes(body, lines.get(entry, {}), call_lines(fn, calls))
    return {"pipes": split["pipes"], "instructions": len(body),
            "region_calls": {str(r["start"]): split["of"][r["start"]] for r in regions(code[entry])
                             if r["start"] in split["of"]}}


def kernel_rows(compiled: dict, sass_dtypes=("float32",), jobs: int = 2) -> list:
    """:func:`analyse` of every kernel and float type of :func:`compile_kernels`' result, with its name and role.

    Parameters
    ----------
    compiled : dict
        What :func:`compile_kernels` returns.
    sass_dtypes : tuple of str
        The float types whose code is disassembled too (``cuobjdump`` takes a
        second a module); none when ``cuobjdump`` is not installed.
    jobs : int
        ``ptxas`` and ``cuobjdump`` processes run at once.

    Returns
    -------
    list of dict
        One row per kernel and float type, sorted by name then type: the keys
        of :func:`analyse` and ``kernel``, ``dtype``, ``assumed`` (the block
        size is the registry's default), ``tags`` and ``role`` (:func:`role`).
    """
    from concurrent.futures import ThreadPoolExecutor

    disassemble = find_tool("cuobjdump") is not None

    def one(job):
        name, t = job
        launch = compiled["launch"][name][t]
        row = analyse(compiled["ptx"][name][t], launch["threads"], sass=disassemble and t in sass_dtypes)
        return dict(row, kernel=name, dtype=t, assumed=launch["assumed"], tags=launch["tags"],
                    role=role(name, launch["tags"]))

    work = [(name, t) for name in sorted(compiled["ptx"]) for t in sorted(compiled["ptx"][name])]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, work))
