"""Building the C++ CPU kernels: a failed build with a toolchain present raises (and fails `make kernels`);
without a compiler or ninja the torch path runs and one log line says why; the switch turns them off."""

import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from radixrt.kernels import cpu_kernels

BROKEN_SOURCE = "int broken_kernel( { return 0; }\n"
needs_toolchain = pytest.mark.skipif(cpu_kernels.unavailable_reason() is not None,
                                     reason=f"builds C++: {cpu_kernels.unavailable_reason()}")


@pytest.fixture
def fresh_load(monkeypatch):
    """load() recomputed under this test's patches, and again afterwards under the real environment."""
    cpu_kernels.load.cache_clear()
    yield cpu_kernels.load
    cpu_kernels.load.cache_clear()


@pytest.fixture
def broken_sources(tmp_path, monkeypatch):
    """A source that cannot compile, built under a temporary extensions folder (the real cache is untouched)."""
    source = tmp_path / "broken_kernel.cpp"
    source.write_text(BROKEN_SOURCE)
    monkeypatch.setattr(cpu_kernels, "SOURCES", [source])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return source


@needs_toolchain
def test_failed_build_raises_with_the_compilers_message(fresh_load, broken_sources):
    with pytest.raises(cpu_kernels.KernelBuildError, match="failed to build") as failure:
        fresh_load()
    message = str(failure.value)
    assert "broken_kernel.cpp:1:" in message and "error:" in message  # the compiler's own diagnostic
    assert "RADIXRT_DISABLE_CPU_KERNELS=1" in message
    assert any(broken_sources.parent.joinpath("extensions").rglob("build.ninja"))  # built in the temp folder


def test_no_compiler_keeps_the_torch_path_and_logs_once(fresh_load, broken_sources, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/nonexistent/radixrt-c++")
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert fresh_load() is None
        assert fresh_load() is None
    assert len(caplog.records) == 1
    assert "no C++ compiler" in caplog.text and "/nonexistent/radixrt-c++" in caplog.text
    assert caplog.records[0].levelno == logging.WARNING


def test_no_ninja_keeps_the_torch_path(fresh_load, broken_sources, monkeypatch, caplog):
    monkeypatch.setenv("CXX", sys.executable)  # any program that exists stands in for the compiler
    monkeypatch.setattr(cpu_kernels, "_find_ninja", lambda: None)
    with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
        assert fresh_load() is None
    assert "no ninja" in cpu_kernels.unavailable_reason() and "no ninja" in caplog.text


def test_switch_turns_the_kernels_off_without_building(fresh_load, broken_sources, monkeypatch):
    monkeypatch.setenv("RADIXRT_DISABLE_CPU_KERNELS", "1")
    assert fresh_load() is None
    assert "RADIXRT_DISABLE_CPU_KERNELS=1" in cpu_kernels.unavailable_reason()


def test_ninja_beside_the_interpreter_counts(monkeypatch, tmp_path):
    """A venv used without activating it: its ninja (a dependency) is found though PATH lacks it."""
    venv_ninja = Path(sysconfig.get_path("scripts")) / "ninja"
    if not venv_ninja.exists():
        pytest.skip("the ninja package is not installed beside this interpreter")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cpu_kernels._find_ninja() == str(venv_ninja)


@needs_toolchain
def test_ninja_found_off_path_is_put_on_path_for_the_build(fresh_load, broken_sources, monkeypatch, tmp_path):
    """torch's builder runs `ninja` from PATH, so a ninja found beside the interpreter is appended to it."""
    monkeypatch.setenv("PATH", os.environ["PATH"])  # restored afterwards
    monkeypatch.setattr(cpu_kernels, "_find_ninja", lambda: str(tmp_path / "venv-bin" / "ninja"))
    with pytest.raises(cpu_kernels.KernelBuildError):
        fresh_load()
    assert os.environ["PATH"].split(os.pathsep)[-1] == str(tmp_path / "venv-bin")


def test_main_reports_the_torch_path_without_a_compiler(fresh_load, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/radixrt-c++")
    assert cpu_kernels.main() == 0
    assert "not built, the torch path runs: no C++ compiler" in capsys.readouterr().out


@needs_toolchain
def test_module_command_exits_nonzero_on_a_failed_build(tmp_path):
    """`make kernels` runs this command: a compiler that fails must fail it."""
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("RADIXRT_DISABLE_CPU_KERNELS", None)
    done = subprocess.run([sys.executable, "-m", "radixrt.kernels.cpu_kernels"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the CPU kernels failed to build with 'false'" in done.stderr


def test_the_first_build_is_announced_with_its_cache_folder(tmp_path, monkeypatch, capsys):
    from radixrt.kernels import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu_kernels._announce_first_build("radixrt_cpu_probe")
    message = capsys.readouterr().err
    assert "compiling the C++ CPU kernels once" in message and str(tmp_path) in message
    (tmp_path / "radixrt_cpu_probe" / "radixrt_cpu_probe.so").write_bytes(b"")
    cpu_kernels._announce_first_build("radixrt_cpu_probe")  # cached: silent
    assert capsys.readouterr().err == ""


ZEN4 = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
SKYLAKE_X = "fpu sse2 avx avx2 fma f16c avx512f avx512dq avx512cd avx512bw avx512vl"
HASWELL = "fpu sse2 avx avx2 fma f16c"


def test_vector_flags_take_the_widest_vectors_the_cpu_has():
    avx512 = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
              "-mavx512dq"]
    assert cpu_kernels.vector_flags(ZEN4) == avx512 + ["-mavx512bf16"]
    assert cpu_kernels.vector_flags(SKYLAKE_X) == avx512
    assert cpu_kernels.vector_flags(HASWELL) == ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]
    assert cpu_kernels.vector_flags("fpu sse2") == ["-DCPU_CAPABILITY=DEFAULT"]
    assert cpu_kernels.vector_flags("fpu sse2 avx512f avx512bw")[0] == "-DCPU_CAPABILITY=DEFAULT"  # no AVX2, VL, DQ


def test_a_narrower_build_switches_off_what_march_native_enabled():
    assert cpu_kernels.vector_levels(ZEN4) == ["avx512bf16", "avx512", "avx2", "default"]
    assert cpu_kernels.vector_levels(HASWELL) == ["avx2", "default"]
    assert cpu_kernels.vector_flags(ZEN4, "avx512")[-1] == "-mno-avx512bf16"
    assert cpu_kernels.vector_flags(ZEN4, "avx2")[:2] == ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    assert "-mno-avx512f" in cpu_kernels.vector_flags(ZEN4, "avx2")
    assert "-mno-avx512f" not in cpu_kernels.vector_flags(HASWELL, "avx2")
    assert cpu_kernels.vector_flags(HASWELL, "avx512") == cpu_kernels.vector_flags(HASWELL)  # never wider than the CPU
    assert {"-mno-avx512f", "-mno-avx2"} <= set(cpu_kernels.vector_flags(ZEN4, "default"))
    with pytest.raises(ValueError, match=cpu_kernels.VECTORS_ENV):
        cpu_kernels.vector_flags(ZEN4, "sse9")


def test_the_build_name_changes_with_the_compiler_flags(monkeypatch):
    monkeypatch.delenv(cpu_kernels.VECTORS_ENV, raising=False)
    widest = cpu_kernels._build_name()
    monkeypatch.setenv(cpu_kernels.VECTORS_ENV, "default")
    assert cpu_kernels._build_name() != widest
    assert cpu_kernels.compile_flags()[:3] == ["-O3", "-march=native", "-fopenmp"]


def narrower_vectors() -> str | None:
    """The next narrower build than this CPU's own (AVX-512 without its bf16 instructions on an AVX512-BF16 CPU,
    AVX2 on an AVX-512 one, ATen's portable vectors on an AVX2 one): across CPUs every level is tested."""
    levels = cpu_kernels.vector_levels(" ".join(cpu_kernels.cpu_flags()))
    return levels[1] if len(levels) > 1 else None


@pytest.mark.slow
@needs_toolchain
@pytest.mark.skipif(narrower_vectors() is None, reason="this CPU builds only ATen's portable vectors")
def test_the_narrower_build_passes_the_kernel_tests_too():
    """The code for the next narrower vectors is built and tested here as well, so a change cannot break the
    CPUs this machine is not: a build in the usual cache (a minute or two the first time), then the kernel tests
    in a child pytest."""
    env = {**os.environ, cpu_kernels.VECTORS_ENV: narrower_vectors()}
    env.pop("RADIXRT_DISABLE_CPU_KERNELS", None)
    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(tests / "test_cpu_kernels.py"), str(tests / "test_cpu_fused_ops.py"),
                           str(tests / "test_cpu_paged_extend.py"),
                           str(tests / "test_cpu_linear.py::test_the_bf16_panels_compute_what_fp32_computes_rounded_once"),
                           str(tests / "test_cpu_linear.py::test_the_bf16_panels_take_any_leading_shape_a_strided_input"
                                       "_and_refuse_bad_ones")],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout
