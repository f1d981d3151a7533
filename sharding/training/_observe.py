"""Seeing inside a run: a `jax.profiler` trace of chosen steps, TensorBoard scalars of every step.

`profile_steps` traces steps ``first..last`` of any loop: the trace starts before the first of
them is dispatched and stops once the last has finished, so it holds those steps and nothing of
the compile or of the other steps. `ScalarLog` writes a step's metrics record (the JSON Lines
one) as TensorBoard scalars, ``train/<key>`` at the record's step, and the run's settings once as
text; only process 0 writes, so a multi-process run has one set of curves.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax

from sharding.training._config import check_folder, parse_window
from sharding.training._errors import TrainingError

TRACE_GLOB = "plugins/profile/*/*.xplane.pb"


class ProfileError(TrainingError):
    """A trace that cannot be taken: another `jax.profiler` trace is already running."""


class StepProfile:
    """A `jax.profiler` trace of steps ``first..last`` (inclusive) of a loop; see `profile_steps`.

    ``files`` lists the ``*.xplane.pb`` files the trace wrote (empty until it stops); beside
    each, ``perfetto_trace.json.gz`` opens in Perfetto (ui.perfetto.dev).
    """

    def __init__(self, directory: str | os.PathLike, first: int, last: int,
                 on_note: Callable[[str], None] | None = None):  # fmt: skip
        self.directory = Path(directory)
        self.first, self.last = parse_window((first, last), call=True)
        check_folder(self.directory, "profile_steps: directory", "traces/run1")
        self.files: list[Path] = []
        self._note = on_note or (lambda message: None)
        self._before: set[Path] = set()
        self._running = self._done = False

    def __enter__(self) -> StepProfile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()  # also when the loop ends early or raises

    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Wrap step ``n``'s dispatch *and* the wait for its result (e.g. ``float(loss)``): the
        trace starts on entering the first step of the window and stops on leaving the last."""
        if not (self._running or self._done) and self.first <= n <= self.last:
            self._start(n)
        if not self._running:
            yield
            return
        with jax.profiler.StepTraceAnnotation("train", step_num=n):
            yield
        if n >= self.last:
            self.stop()

    def _start(self, n: int) -> None:
        self._before = set(self.directory.glob(TRACE_GLOB))
        try:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        except RuntimeError as e:  # "Profile has already been started"
            raise ProfileError(
                f"cannot trace steps {self.first}..{self.last} into {self.directory}: {e} "
                f"(a jax.profiler trace is already running in this process; stop it first, or "
                f"drop --profile)"
            ) from None
        self._running = True
        devices = jax.devices()
        if devices[0].platform == "cpu":
            self._note(
                f"profiling steps {n}..{self.last} on {len(devices)} simulated CPU devices: the "
                f"trace's device timelines are simulated too (every 'device' shares this host's "
                f"cores), so read it for which ops and collectives run in what order, not for "
                f"their times"
            )

    def stop(self) -> None:
        """Stop the trace now, if it runs (`step` stops it after the window's last step)."""
        if not self._running:
            return
        self._running, self._done = False, True
        jax.profiler.stop_trace()
        self.files = sorted(set(self.directory.glob(TRACE_GLOB)) - self._before)
        where = ", ".join(str(f) for f in self.files) or str(self.directory)
        self._note(
            f"trace of steps {self.first}..{self.last}: {where} (view: tensorboard --logdir "
            f"{self.directory}, Profile tab; or perfetto_trace.json.gz beside it in "
            f"ui.perfetto.dev)"
        )


def profile_steps(
    directory: str | os.PathLike,
    first: int,
    last: int,
    *,
    on_note: Callable[[str], None] | None = None,
) -> StepProfile:
    """A context manager tracing steps ``first..last`` (inclusive) of a loop into ``directory``.

    The trace lands in ``directory/plugins/profile/<time>/`` (``<host>.xplane.pb`` for
    TensorBoard's profile plugin, ``perfetto_trace.json.gz`` for Perfetto). Wrap each step,
    dispatch and wait, in ``prof.step(n)``; steps outside the window run untraced. ``on_note``
    receives what is worth saying (on simulated CPU devices: that their timelines are too; the
    files written). Raises `TrainingError` for a bad window or a ``directory`` that is a file,
    before anything is written. `fit` does this for ``TrainConfig(profile=..., profile_steps=...)``.

    Example:
        >>> import jax.numpy as jnp
        >>> with profile_steps(tmp / "traces", 2, 3) as prof:  # doctest: +SKIP
        ...     for n in range(1, 5):
        ...         with prof.step(n):
        ...             float(jnp.ones(4).sum())  # the step, and the wait for its result
        >>> [f.name for f in prof.files]  # doctest: +SKIP
        ['myhost.xplane.pb']
    """
    return StepProfile(directory, first, last, on_note)


class ScalarLog:
    """TensorBoard event files of a run in ``directory`` (`tensorboardX`), on process 0 only.

    `write` takes a metrics record (``{"step": n, "loss": ..., ...}``) and writes every other
    number as the scalar ``train/<key>`` at step ``n``; `close` flushes and closes (safe twice).
    On any process but 0 both do nothing.
    """

    def __init__(self, directory: str | os.PathLike, settings: dict[str, Any], step: int = 0):
        self.writer = None
        if jax.process_index() != 0:
            return
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(os.fspath(directory))
        self.writer.add_text("settings", settings_markdown(settings), step)

    def write(self, record: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self.writer.add_scalar(f"train/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def step_extras(
    config: Any, schedule: Callable[[int], Any], report: Any, program: Any
) -> Callable[[int, float], dict[str, float]]:
    """Per-step numbers beyond loss and time: ``lr``, the learning rate of the step's update
    (``schedule``), and ``mfu`` where it means something: an accelerator with a datasheet peak
    (`sharding.inspection.device_peak`), and a step whose compiled matmul FLOPs are the model's
    own (no recompute, no pipeline ticks computing on bubbles). Simulated CPU devices get none."""
    from sharding.inspection import UnknownDeviceKindError, device_peak

    device, peak_s = jax.devices()[0], None
    if device.platform != "cpu" and config.remat == "none" and program.schedule is None:
        with contextlib.suppress(UnknownDeviceKindError):
            peak_s = (report.matmul_flops or 0) / device_peak(device.device_kind, config.dtype)

    def extras(step: int, elapsed: float) -> dict[str, float]:
        out = {"lr": float(schedule(step))}  # the update after `step` updates
        if peak_s:
            out["mfu"] = peak_s / elapsed
        return out

    return extras


def settings_markdown(settings: dict[str, Any]) -> str:
    """The settings as a two-column Markdown table (TensorBoard's text tab renders it).

    Example:
        >>> print(settings_markdown({"steps": 3, "mesh": "data=8"}))
        | setting | value |
        |---|---|
        | steps | 3 |
        | mesh | data=8 |
    """
    rows = [f"| {k} | {v} |" for k, v in settings.items()]
    return "\n".join(["| setting | value |", "|---|---|", *rows])
