"""The machine a tour ran on, as the line under each of its tables names it: the CPU's model, the
cores the tour could use, and whether the CPU has bfloat16 arithmetic.

Times on a CPU say little without the CPU: where it has no bfloat16 arithmetic, the bfloat16
steps (03 on) train many times slower than float32's 01, and a table made there reads as if the
technique were slow. The runner reads the machine once, as the tour starts, into tour.json
("machine"); the report writes its line under the tour's table and the estimate's, so a table
rebuilt later (python -m tour.report) still names the machine that made its numbers.

A published table can hold rows from several machines (python -m tour --publish DIR --steps NN
rewrites only some rows): then each row made elsewhere than the unmarked rows carries a mark after
its step ("05a_adamw_8bit (branch of 04) ¹"), and under the table a line per mark names its
machine ("¹ Made on ..."), so the file alone says which machine made each row.
"""
import os
import platform
import re
import subprocess
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")  # Linux; elsewhere the model is platform's, its flags unknown
CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # a container's share of the cores (cgroup v2)
# the flags Linux gives a CPU with bfloat16 arithmetic: x86's AVX-512 BF16 and AMX, Arm's BF16
# (in its "Features" line) and SVE's
BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16", "svebf16")
MADE_ON = "Made on "  # how the line under a table starts
MARK_DIGITS = "⁰¹²³⁴⁵⁶⁷⁸⁹"  # a row's mark is a number in superscript: ¹, ², ... ¹⁰
MARKED_LINE = re.compile(f"^(?:(?P<mark>[{MARK_DIGITS}]+) )?(?P<line>{MADE_ON}.*)$")
MARKED_CELL = re.compile(f" (?P<mark>[{MARK_DIGITS}]+)$")
# the line for rows of a table published before tables named their machine, once rows made on a
# named machine join them
UNRECORDED = f"{MADE_ON}a machine not recorded (published before tables named theirs)."


def cpuinfo_value(cpuinfo, *keys):
    """The value of the first line of /proc/cpuinfo's text that starts with one of `keys`."""
    for line in cpuinfo.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() in keys and value.strip():
            return value.strip()
    return None


def lscpu_model():
    """lscpu's "Model name" (on Arm, /proc/cpuinfo names no model and lscpu decodes its part), or
    None."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return cpuinfo_value(text, "Model name")


def cores_used():
    """The cores this process may run on, at most its container's quota of them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = CPU_QUOTA.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))  # a part of a core: one
    except (OSError, ValueError):
        pass
    return cores


def this_machine():
    """{"cpu": its model, "cores_used": N, "bfloat16": the bfloat16 flags it has ([] for none),
    or None where no flags could be read (no /proc/cpuinfo: macOS, Windows)}."""
    try:
        cpuinfo = CPUINFO.read_text(errors="replace")
    except OSError:
        cpuinfo = None
    flags = cpuinfo and cpuinfo_value(cpuinfo, "flags", "Features")
    model = ((cpuinfo and cpuinfo_value(cpuinfo, "model name")) or lscpu_model()
             or platform.processor() or platform.machine() or None)
    return {"cpu": model, "cores_used": cores_used(),
            "bfloat16": None if flags is None else [flag for flag in BFLOAT16_FLAGS
                                                    if flag in flags.split()]}


def machine_line(machine):
    """The line under a table: "Made on AMD EPYC, 2 cores used, with bfloat16 arithmetic
    (avx512_bf16).", or None for a tour that did not record its machine."""
    if not isinstance(machine, dict):
        return None
    cores = machine.get("cores_used")
    flags = machine.get("bfloat16")
    if flags is None:
        arithmetic = "its bfloat16 arithmetic unknown (no CPU flags to read)"
    elif flags:
        arithmetic = f"with bfloat16 arithmetic ({', '.join(map(str, flags))})"
    else:
        arithmetic = (f"without bfloat16 arithmetic (none of the flags {', '.join(BFLOAT16_FLAGS)}), "
                      "where the bfloat16 steps train many times slower than float32's")
    return (f"{MADE_ON}{machine.get('cpu') or 'an unnamed CPU'}, "
            + (f"{cores} core{'s' if cores != 1 else ''} used, " if isinstance(cores, int) else "")
            + f"{arithmetic}.")


def nth_mark(number):
    """The mark of the `number`th machine other than the unmarked rows': "¹", "²", ... "¹⁰"."""
    return str(number).translate(str.maketrans("0123456789", MARK_DIGITS))


def mark_number(mark):
    """The number a mark writes ("¹" -> 1), 0 for none: the order of the lines under a table."""
    return int(mark.translate(str.maketrans(MARK_DIGITS, "0123456789")) or 0)


def read_machine_line(text):
    """(its mark, the line without it) for a line naming a machine: ("", "Made on ...") unmarked,
    ("¹", "Made on ...") for "¹ Made on ..."; None for any other line."""
    match = MARKED_LINE.match(text)
    return (match["mark"] or "", match["line"]) if match else None


def marked_line(mark, line):
    """The line under a table naming the machine of the rows marked `mark` ("" for unmarked)."""
    return f"{mark} {line}" if mark else line


def cell_mark(step_cell):
    """The mark a table's step cell carries ("¹"), or "" for an unmarked row."""
    match = MARKED_CELL.search(step_cell)
    return match["mark"] if match else ""


def without_mark(step_cell):
    """The step cell without its mark: what the report wrote."""
    return MARKED_CELL.sub("", step_cell)
