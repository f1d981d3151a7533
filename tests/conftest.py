"""8 simulated CPU devices for every test; must run before any JAX computation."""

import os
import subprocess
import sys

# Tests assert facts of the compiled HLO (collectives, FLOPs, buffer sizes) and numerics, not the
# speed of the generated CPU code, so they compile for the least time: LLVM's optimisation passes
# are skipped (a third of the compile), and fusions are emitted by XLA:CPU's direct emitters
# instead of its MLIR fusion emitters (half of what is left, on llama tiny dp, fsdp_tp and pp
# steps). Both change only how CPU code is generated, after partitioning and fusion. A jax that
# does not know the second flag would abort on it, so it is probed once. The variables set here
# reach xdist's workers and every subprocess a test starts. Benchmarks never set them.
_FAST = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _accepted(flag: str) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env={**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {flag}"},
        capture_output=True,
        timeout=120,
    )
    return probe.returncode == 0


_flags = os.environ.get("XLA_FLAGS", "")
_missing = [f for f in _FAST if f.split("=")[0] not in _flags]
_flags = " ".join([_flags, *(f for f in _missing if f == _FAST[0] or _accepted(f))]).strip()
os.environ["XLA_FLAGS"] = _flags

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
# 8, or what SPMDKIT_TEST_DEVICES says: tests/test_compositions.py runs its 16-device cases in a
# child pytest with 16, so every mesh of 16 runs apart from the rest of the suite.
_DEVICES = int(os.environ.get("SPMDKIT_TEST_DEVICES", "8"))
jax.config.update("jax_num_cpu_devices", _DEVICES)
# Start the backend now, so that a library call simulating another count (plan or compare for a
# 16-device target) is refused in this process instead of changing it for every later test.
assert jax.device_count() == _DEVICES

import re  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """After each test module, drop the programs it compiled and cached (its functools caches)
    and jax's own caches: a worker process otherwise holds every module's executables until the
    end of the suite, and its memory grows with the suite (a late compile segfaulted once)."""
    yield
    import gc

    for value in list(vars(request.module).values()):
        if callable(getattr(value, "cache_clear", None)) and hasattr(value, "cache_info"):
            value.cache_clear()
    jax.clear_caches()
    gc.collect()


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under ``root``: path -> (kind, size, mtime_ns)."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.stat()
        out[str(p.relative_to(root))] = ("d" if p.is_dir() else "f", st.st_size, st.st_mtime_ns)
    return out


def _check_refusal(rc: int, out: str, err: str, match: str) -> str:
    assert rc == 2, f"exit {rc}, expected 2\nstdout: {out}\nstderr: {err}"
    assert "Traceback" not in out + err, err
    assert re.search(match, err), f"{match!r} not in stderr:\n{err}"
    return err


@pytest.fixture
def refused(tmp_path, monkeypatch, capsys):
    """``refused(args, match)``: `spmdkit ARGS`, run in ``tmp_path``, exits 2 with a message
    matching ``match`` on stderr, prints no traceback, and creates or changes no file there.

    ``subprocess=True`` runs it in a fresh interpreter (for device counts other than the 8 the
    test process has); ``env`` adds environment variables there. Files the test made in
    ``tmp_path`` beforehand are part of the snapshot, so "changes nothing" covers them too.
    """
    from sharding.cli import main

    monkeypatch.chdir(tmp_path)

    def check(args: list[str], match: str, *, subprocess_: bool = False, env=None) -> str:
        before = snapshot(tmp_path)
        if subprocess_:
            import os

            code = "import sys; from sharding.cli import main; sys.exit(main(sys.argv[1:]))"
            proc = subprocess.run(
                [sys.executable, "-c", code, *args],
                capture_output=True,
                text=True,
                cwd=tmp_path,
                timeout=300,
                env={**os.environ, **(env or {})},
            )
            rc, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            try:
                rc = main(args)
            except SystemExit as e:  # argparse refuses with exit 2
                rc = e.code
            captured = capsys.readouterr()
            out, err = captured.out, captured.err
        _check_refusal(rc, out, err, match)
        assert snapshot(tmp_path) == before, "a refused command created or changed files"
        return err

    return check


@pytest.fixture
def unchanged(tmp_path, monkeypatch):
    """A context manager asserting nothing under ``tmp_path`` (the cwd) changes inside it."""
    import contextlib

    monkeypatch.chdir(tmp_path)

    @contextlib.contextmanager
    def guard():
        before = snapshot(tmp_path)
        yield tmp_path
        assert snapshot(tmp_path) == before, "a refused call created or changed files"

    return guard


@pytest.fixture
def doctests():
    """``doctests(package)``: run the docstring examples of every public name of ``package``
    (its ``__all__``), found through the public objects, never through private modules; returns
    how many examples ran, and fails on any that fails."""
    import doctest
    import inspect

    import models

    def run(package) -> int:
        finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
        ran, seen = 0, set()
        for name in package.__all__:
            obj = getattr(package, name)
            module = inspect.getmodule(obj)  # the examples see their own module's names,
            globs = {**(vars(module) if module else {}), "models": models, "llama": models.llama}
            for test in finder.find(obj, name, globs=globs):  # and the shipped families
                if test.examples and id(test) not in seen and test.name not in seen:
                    seen.add(test.name)
                    runner.run(test)
                    ran += len(test.examples)
        result = runner.summarize(verbose=False)
        assert result.failed == 0, f"{result.failed} docstring example(s) failed in {package}"
        return ran

    return run
