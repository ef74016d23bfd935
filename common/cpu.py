"""What this CPU can do, asked in one place: its instruction-set flags, the target the native kernels are
compiled for, and whether it multiplies bfloat16 natively.

`PAGEDSERVE_CPU_ISA=avx2` makes every answer here the one an AVX2-only (x86-64-v3) machine would give, on
any x86 machine with AVX2: the flags lose everything beyond x86-64-v3, the native kernels are compiled for
`-march=x86-64-v3` (a build of their own: the build directory is keyed by the flags) and bfloat16 products
count as emulated. torch and oneDNN pick their own kernels: run with `ATEN_CPU_CAPABILITY=avx2` and
`ONEDNN_MAX_CPU_ISA=AVX2` beside it (`make test-avx2`, docs/testing.md) so that they take their AVX2 code
too.
"""

import os
from pathlib import Path

import torch

ISA_ENV = "PAGEDSERVE_CPU_ISA"
# native: what the CPU has; avx2: as an x86-64-v3 machine (AVX2, FMA, F16C, BMI) without AVX-512 or AMX.
ISA_PROFILES = {"native": "native", "avx2": "x86-64-v3"}
CPUINFO = Path("/proc/cpuinfo")
SYS_CPUS = Path("/sys/devices/system/cpu")
# Flag prefixes of the extensions beyond x86-64-v3 (AVX-512 and its BF16/VNNI/FP16 parts, AMX, AVX-VNNI,
# AVX-NE-CONVERT, AVX-IFMA): the ones an AVX2-only CPU lacks.
_BEYOND_AVX2 = ("avx512", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma")


class IsaError(ValueError):
    """PAGEDSERVE_CPU_ISA names no profile."""


def profile() -> str:
    """The profile the checks answer for: `native` unless PAGEDSERVE_CPU_ISA says `avx2`."""
    name = os.environ.get(ISA_ENV, "native").strip().lower() or "native"
    if name not in ISA_PROFILES:
        raise IsaError(f"{ISA_ENV}={name!r}: choose one of {', '.join(ISA_PROFILES)}")
    return name


def march() -> str:
    """The -march the native kernels are compiled for."""
    return ISA_PROFILES[profile()]


def _cpuinfo_field(field: str, cpuinfo: Path) -> str:
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith(field):
            return line.partition(":")[2].strip()
    return ""


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU's flags (/proc/cpuinfo) as the profile sees them."""
    flags = frozenset(_cpuinfo_field("flags", cpuinfo).split())
    if profile() == "avx2":
        flags = frozenset(flag for flag in flags if not flag.startswith(_BEYOND_AVX2))
    return flags


def bfloat16_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX); False under the avx2 profile.
    The `--weights bfloat16` mode's condition in a float32 model: elsewhere oneDNN emulates those products."""
    if profile() == "avx2":
        return False
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def isa_level(flags: frozenset[str]) -> str:
    """The widest vector ISA among `flags`: AMX, AVX-512, AVX2 or baseline."""
    if "amx_tile" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "baseline"


def physical_cores(cpus: set[int] | None = None, sys_cpus: Path = SYS_CPUS) -> int:
    """How many physical cores the CPUs this process may run on (its affinity, or `cpus`) belong to: SMT
    siblings (hyper-threads of one core) count once. Where the topology cannot be read, every CPU counts."""
    cpus = os.sched_getaffinity(0) if cpus is None else cpus
    cores = set()
    for n in cpus:
        topology = sys_cpus / f"cpu{n}" / "topology"
        try:
            cores.add(
                ((topology / "physical_package_id").read_text().strip(), (topology / "core_id").read_text())
            )
        except OSError:
            cores.add(("cpu", str(n)))
    return max(1, len(cores))


def describe(cpuinfo: Path = CPUINFO, sys_cpus: Path = SYS_CPUS) -> str:
    """One line naming the machine: CPU model, its CPUs (and the physical cores they are), the ISA the
    checks see, the profile and torch's kernels."""
    flags = cpu_flags(cpuinfo)
    named = (("avx512_bf16", "AVX512-BF16"), ("avx512_vnni", "VNNI"))
    extras = [name for flag, name in named if flag in flags]
    model = _cpuinfo_field("model name", cpuinfo) or "unknown CPU"
    cpus = os.sched_getaffinity(0)
    return (
        f"{model}, {len(cpus)} CPUs on {physical_cores(cpus, sys_cpus)} cores, {isa_level(flags)}"
        + "".join(f" + {extra}" for extra in extras)
        + f" (profile {profile()}, torch kernels {torch.backends.cpu.get_cpu_capability()})"
    )
