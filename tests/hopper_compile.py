"""pytest plugin: build every Triton kernel a test launches for a Hopper GPU (sm_90), on a
machine without one, and report what fails to build.

The CPU suite runs kernels in Triton's interpreter, which accepts code the compiler
rejects (and knows nothing of shared memory or register limits), so a kernel can pass
every CPU test and still fail its first compile on the GPU. With this plugin the same
tests build their kernels for real: Triton's compiler, then ptxas (bundled with Triton),
for `TARGET`. A compile-only driver stands in for CUDA: the built kernel is never
launched, so outputs stay as allocated and the tests' numeric assertions fail; what this
run reports is only the kernels that did not build (any exception raised by Triton
itself), or a built kernel over Hopper's shared memory or thread limits.

    scripts/hopper_compile_check.sh [pytest args]   # see its header

The environment keeps TRITON_INTERPRET=1 so tests and kernel wrappers take their CPU
paths (host tensors accepted, interpreter-only tests selected); Triton's own switch is
turned off here before any kernel is decorated, so each kernel is a compiled JITFunction.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import traceback
from pathlib import Path

import pytest

os.environ.pop("TRITON_INTERPRET", None)  # Triton's own library: built for the compiler

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

knobs.runtime.interpret = False  # every @triton.jit from here on builds for the compiler
os.environ["TRITON_INTERPRET"] = "1"  # kvloom's and the tests' CPU paths (see above)
# Read by tests/triton_interpret/conftest.py: its kernel checks run in this process.
os.environ["KVLOOM_HOPPER_COMPILE"] = "1"

TARGET = GPUTarget("cuda", 90, 32)
# An H100/H200 SM: the limits CompiledKernel checks before a launch.
HOPPER_PROPERTIES = {
    "max_shared_mem": 232448,
    "multiprocessor_count": 132,
    "max_num_regs": 65536,
    "warpSize": 32,
    "sm_clock_rate": 1980000,
    "mem_clock_rate": 2619000,
    "mem_bus_width": 5120,
}
REPORT_ENV = "KVLOOM_HOPPER_COMPILE_REPORT"


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
HOPPER_REGISTERS = 65536  # per SM and per block


def resource_usage(cubin: bytes) -> dict[str, int]:
    """{"REG", "STACK", "SHARED", "LOCAL", ...} of a built kernel, from cuobjdump (bundled
    with Triton): registers per thread, and LOCAL bytes (register spills) per thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [str(CUOBJDUMP), "-res-usage", file.name], capture_output=True, text=True
        ).stdout
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", text)}


class _CompileOnlyUtils:
    def load_binary(self, name, kernel, shared, device):
        """What cuModuleLoadData would say: registers, spilled bytes, and the largest block
        the registers allow (CompiledKernel checks num_warps against it)."""
        usage = resource_usage(kernel)
        # Spilled registers live in the stack frame (ptxas -v: "spill stores").
        regs, spills = usage.get("REG", 0), usage.get("STACK", 0) + usage.get("LOCAL", 0)
        per_thread = max(8, -(-regs // 8) * 8)  # allocated in units of 8
        max_threads = min(1024, HOPPER_REGISTERS // per_thread // 32 * 32)
        return object(), object(), regs, spills, max_threads

    def get_device_properties(self, device):
        return dict(HOPPER_PROPERTIES)

    def unload_module(self, module):
        pass


class CompileOnlyDriver:
    """Triton's active driver for a build-only run: reports a Hopper target and turns
    every launch into nothing."""

    compile_only = True

    def __init__(self) -> None:
        self.utils = _CompileOnlyUtils()

    def launcher_cls(self, src, metadata):
        return lambda *args, **kwargs: None

    def is_active(self) -> bool:
        return True

    def get_current_target(self):
        return TARGET

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("compile-only driver: no benchmarking")


class BuildReport:
    """Kernel builds seen (name -> count) and build failures (test, kernel, error)."""

    def __init__(self) -> None:
        self.built: dict[str, int] = {}
        self.failures: list[dict] = []
        self.registers: dict[str, int] = {}  # kernel -> most registers per thread seen
        self.spills: dict[str, int] = {}  # kernel -> most LOCAL bytes per thread seen

        self.spilling: list[dict] = []  # variants with a stack frame: kernel, constexprs

    def record_usage(self, src, kernel) -> None:
        name = src.fn.__name__
        usage = resource_usage(kernel.asm["cubin"])
        regs, spills = usage.get("REG", 0), usage.get("STACK", 0) + usage.get("LOCAL", 0)
        self.registers[name] = max(self.registers.get(name, 0), regs)
        if spills:
            self.spills[name] = max(self.spills.get(name, 0), spills)
            names = src.fn.arg_names
            constexprs = {
                names[key[0]] if isinstance(key, tuple) and len(key) == 1 else str(key): value
                for key, value in src.constants.items()
            }
            constexprs["num_warps"] = kernel.metadata.num_warps
            constexprs["num_stages"] = kernel.metadata.num_stages
            self.spilling.append(
                {"kernel": name, "bytes": spills, "registers": regs, "constexprs": constexprs}
            )

    def wrap_compile(self):
        from triton import compiler

        real = compiler.compile

        def compile(src, target=None, options=None, *args, **kwargs):
            name = getattr(getattr(src, "fn", None), "__name__", str(src))
            try:
                kernel = real(src, target, options, *args, **kwargs)
            except Exception as error:
                self.failures.append(
                    {"kernel": name, "error": _first_lines(error), "where": _where(error)}
                )
                raise
            self.built[name] = self.built.get(name, 0) + 1
            if hasattr(src, "fn") and "cubin" in kernel.asm:
                self.record_usage(src, kernel)
            return kernel

        compiler.compile = compile

    def summary(self) -> dict:
        return {
            "target": f"{TARGET.backend} sm_{TARGET.arch}",
            "triton": triton.__version__,
            "kernels_built": dict(sorted(self.built.items())),
            "variants_built": sum(self.built.values()),
            "max_registers": dict(sorted(self.registers.items())),
            "spilled_bytes": dict(sorted(self.spills.items())),
            "spilling_variants": self.spilling,
            "failures": self.failures,
        }


def _first_lines(error: BaseException, lines: int = 12) -> str:
    text = f"{type(error).__name__}: {error}"
    return "\n".join(text.splitlines()[:lines])


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "/triton/" not in f.filename and f.filename != __file__]
    frame = (ours or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else ""


REPORT = BuildReport()


def pytest_configure(config):
    driver.set_active(CompileOnlyDriver())
    REPORT.wrap_compile()


def _triton_error(excinfo) -> BaseException | None:
    return _triton_error_chain(excinfo.value) if excinfo else None


def _triton_error_chain(error: BaseException | None) -> BaseException | None:
    """The first exception in the chain raised by Triton's own modules (a build error,
    or a built kernel over the target's limits), else None."""
    while error is not None:
        if type(error).__module__.startswith("triton."):
            return error
        error = error.__cause__ or error.__context__
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    error = _triton_error(call.excinfo) if report.failed else None
    if error is not None and not any(f.get("test") == item.nodeid for f in REPORT.failures):
        recorded = [f for f in REPORT.failures if "test" not in f]
        if recorded:  # a compile failure wrap_compile saw: name the test that hit it
            for failure in recorded:
                failure["test"] = item.nodeid
        else:  # over a limit at launch (shared memory, threads)
            REPORT.failures.append(
                {"test": item.nodeid, "kernel": "", "error": _first_lines(error), "where": ""}
            )


def summary_lines(summary: dict) -> list[str]:
    """The build summary as printed: totals, spilling kernels, failures with their errors."""
    lines = [
        f"HOPPER BUILD {summary['target']} triton {summary['triton']}: "
        f"{summary['variants_built']} variants of {len(summary['kernels_built'])} kernels "
        f"built, {len(summary['failures'])} failures"
    ]
    for name, spilled in summary["spilled_bytes"].items():
        lines.append(
            f"SPILLS {name}: up to {spilled} bytes per thread in local memory (stack frame)"
        )
    for failure in summary["failures"]:
        test = f" ({failure['test']})" if "test" in failure else ""
        lines.append(f"BUILD FAILED {failure['kernel']}{test} {failure['where']}")
        lines.extend(f"    {line}" for line in failure["error"].splitlines())
    return lines


def write_report(summary: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(json.dumps(summary, indent=2))


def pytest_terminal_summary(terminalreporter):
    summary = REPORT.summary()
    for line in summary_lines(summary):
        terminalreporter.write_line(line)
    write_report(summary)


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.hopper_compile SCRIPT [ARGS...]`: runs a script (a kernel benchmark
    at its real shapes, say) with every launch built for TARGET and none run; prints the
    build summary and returns 1 if any kernel failed to build."""
    import runpy
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(main.__doc__)
        return 2
    driver.set_active(CompileOnlyDriver())
    REPORT.wrap_compile()
    sys.argv = list(argv)
    sys.path.insert(0, str(Path(argv[0]).resolve().parent))
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        pass
    except Exception as error:  # the script's own failure: report it beside the builds
        if not REPORT.failures or _triton_error_chain(error) is None:
            print(f"SCRIPT FAILED {_first_lines(error)}")
    summary = REPORT.summary()
    print("\n".join(summary_lines(summary)))
    write_report(summary)
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
