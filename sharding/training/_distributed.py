"""Multi-process (multi-host) runs on `jax.distributed`: who the coordinator is, how many processes.

A run is multi-process when the flags or the environment name more than one process. Sources,
first match wins:

1. flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. ``SPMDKIT_COORDINATOR``, ``SPMDKIT_NUM_PROCESSES``, ``SPMDKIT_PROCESS_ID`` (on a Kubernetes
   Indexed Job the id may come from ``JOB_COMPLETION_INDEX`` instead; point the coordinator at
   pod 0 through a headless service, e.g. ``myjob-0.myjob-svc:1234``);
3. torchrun style ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``;
4. SLURM (``srun``): ``SLURM_NTASKS`` > 1, left to `jax.distributed.initialize`'s own detection.

Each process then owns its local devices (on a CPU-only host: ``--devices`` simulated CPU devices
per process, collectives over gloo), the mesh spans every process's devices, and each process
loads only its rows of the global batch. Liveness is bounded: the coordination service notices a
dead peer within ``heartbeat_timeout_s`` and fails the collectives of the others, so they stop
with an error instead of waiting forever (what a failed process then prints and how it exits is
the CLI's policy, `sharding.cli`).

`join_run` does it all from plain arguments: settings, devices per process, `initialize`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from sharding._devices import cpu_only
from sharding._mesh import MeshSpec
from sharding.training._errors import TrainingError

HEARTBEAT_TIMEOUT_S = 10
INIT_TIMEOUT_S = 120
DEFAULT_GLOBAL_CPU_DEVICES = 8


class DistributedConfigError(TrainingError):
    """The multi-process settings (flags or environment) are incomplete or inconsistent."""


class DistributedInitError(RuntimeError):
    """`jax.distributed.initialize` failed: the coordinator or a peer never answered."""


@dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in a multi-process run, and where the settings came from.

    ``coordinator`` is None only for SLURM, where `jax.distributed.initialize` finds it itself.
    """

    coordinator: str | None
    num_processes: int
    process_id: int
    source: str

    def __str__(self) -> str:
        where = self.coordinator or "auto-detected"
        return f"process {self.process_id} of {self.num_processes} (coordinator {where}, {self.source})"


def _int(value: str | int | None, name: str, source: str) -> int | None:
    if value is None or isinstance(value, int):
        return value
    try:
        return int(value)
    except ValueError:
        raise DistributedConfigError(
            f"{name}={value!r} (from {source}) is not an integer; set it to a whole number"
        ) from None


def _check_address(address: str, source: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedConfigError(
            f"coordinator address {address!r} (from {source}) is not HOST:PORT; write e.g. "
            f"'10.0.0.1:1234' or '127.0.0.1:{port if port.isdigit() else 1234}'"
        )
    return address


def resolve_process_group(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ProcessGroup | None:
    """The multi-process settings from flags, else the environment; None for one process.

    Example:
        >>> resolve_process_group("127.0.0.1:1234", 2, 1, env={})
        ProcessGroup(coordinator='127.0.0.1:1234', num_processes=2, process_id=1, source='flags')
        >>> resolve_process_group(env={"WORLD_SIZE": "1", "RANK": "0"}) is None
        True
    """
    env = os.environ if env is None else env
    flags = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}  # fmt: skip
    if any(v is not None for v in flags.values()):
        values, source = flags, "flags"
    elif "SPMDKIT_COORDINATOR" in env or "SPMDKIT_NUM_PROCESSES" in env:
        pid = env.get("SPMDKIT_PROCESS_ID", env.get("JOB_COMPLETION_INDEX"))
        values = {"SPMDKIT_COORDINATOR": env.get("SPMDKIT_COORDINATOR"),
                  "SPMDKIT_NUM_PROCESSES": env.get("SPMDKIT_NUM_PROCESSES"),
                  "SPMDKIT_PROCESS_ID": pid}  # fmt: skip
        source = "SPMDKIT_* environment"
    elif "WORLD_SIZE" in env:
        addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        values = {"MASTER_ADDR:MASTER_PORT": f"{addr}:{port}" if addr and port else None,
                  "WORLD_SIZE": env.get("WORLD_SIZE"), "RANK": env.get("RANK")}  # fmt: skip
        source = "torchrun environment"
    elif "SLURM_JOB_ID" in env and "SLURM_NTASKS" in env:
        n = _int(env["SLURM_NTASKS"], "SLURM_NTASKS", "SLURM")
        pid = _int(env.get("SLURM_PROCID", "0"), "SLURM_PROCID", "SLURM")
        return None if n == 1 else ProcessGroup(None, n, pid, "SLURM")
    else:
        return None
    (_, addr), (n_name, n), (id_name, pid) = values.items()
    n, pid = _int(n, n_name, source), _int(pid, id_name, source)
    if n is not None and n < 1:
        raise DistributedConfigError(f"{n_name}={n} (from {source}) must be >= 1")
    if n == 1 and pid in (None, 0):
        return None
    missing = [k for k, v in values.items() if v is None]
    if missing:
        given = ", ".join(f"{k}={v}" for k, v in values.items() if v is not None)
        raise DistributedConfigError(
            f"multi-process settings from {source} are incomplete: {given} given, but "
            f"{', '.join(missing)} missing; give all three (or none, for one process)"
        )
    if not 0 <= pid < n:
        raise DistributedConfigError(
            f"{id_name}={pid} is outside 0..{n - 1} ({n_name}={n}, from {source}); "
            f"number the processes 0..{n - 1}"
        )
    return ProcessGroup(_check_address(addr, source), n, pid, source)


def devices_per_process(group: ProcessGroup, devices: int | None, mesh_size: int | None) -> int:
    """Simulated CPU devices for each process: ``devices``, else the mesh's share, else 8 / N."""
    n = group.num_processes
    if devices is not None:
        if devices < 1:
            raise DistributedConfigError(f"--devices {devices} must be >= 1 (devices per process)")
        return devices
    total = mesh_size if mesh_size is not None else DEFAULT_GLOBAL_CPU_DEVICES
    if total % n:
        raise DistributedConfigError(
            f"the mesh needs {total} devices in all, which do not split evenly over "
            f"{n} processes; pass --devices K (simulated CPU devices per process) with "
            f"K x {n} equal to the mesh size, or change the mesh"
        )
    return total // n


def initialize(
    group: ProcessGroup,
    cpu_devices: int | None = None,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    init_timeout_s: int = INIT_TIMEOUT_S,
) -> None:
    """Join the run: gloo CPU collectives, ``cpu_devices`` simulated devices, `jax.distributed`.

    Must run before any JAX computation. A dead peer is noticed by the coordination service within
    ``heartbeat_timeout_s`` and the survivors' collectives fail instead of waiting; the shutdown
    barrier at exit is bounded by the same time, so a survivor never waits long for a peer that is
    gone.

    Example:
        >>> initialize(ProcessGroup("10.0.0.1:1234", 2, 0, "flags"), cpu_devices=4)  # doctest: +SKIP
    """
    import jax

    from sharding._mesh import simulate_cpu_devices

    if cpu_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        simulate_cpu_devices(cpu_devices)
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=init_timeout_s,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            shutdown_timeout_seconds=heartbeat_timeout_s,
        )
    except Exception as e:  # the runtime raises bare RuntimeErrors (XlaRuntimeError)
        raise DistributedInitError(
            f"{group}: could not join the run within {init_timeout_s} s: "
            f"{str(e).strip().splitlines()[0]}. Check that all {group.num_processes} processes "
            f"started with the same coordinator and process count and distinct ids"
        ) from e


@dataclass(frozen=True)
class JoinedRun:
    """This process's place in the multi-process run `join_run` joined.

    ``devices`` is the number of simulated CPU devices of this process (None on a host with real
    accelerators, where each process owns its local devices).
    """

    group: ProcessGroup
    devices: int | None
    heartbeat_timeout_s: int

    @property
    def writes_metrics(self) -> bool:
        """Whether this process writes the per-step metrics file: process 0 only, so the file
        has one line per step, not one per process."""
        return self.group.process_id == 0

    def to_dict(self) -> dict:
        return {**asdict(self.group), "devices": self.devices,
                "heartbeat_timeout_s": self.heartbeat_timeout_s}  # fmt: skip

    def __str__(self) -> str:
        return str(self.group)


def join_run(
    *,
    mesh: str | MeshSpec | None = None,
    devices: int | None = None,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> JoinedRun | None:
    """Join the multi-process run the arguments (else the environment) describe; None for one.

    Call before anything initialises JAX. On a CPU-only host each process simulates ``devices``
    CPU devices, or its share of ``mesh`` (the mesh size / the number of processes). The
    arguments are checked first, whether or not the run is multi-process.

    Example:
        >>> join_run(mesh="data=2,fsdp=2,tensor=2", env={}) is None  # one process: nothing to do
        True
    """
    if (isinstance(heartbeat_timeout_s, bool) or not isinstance(heartbeat_timeout_s, int)
            or heartbeat_timeout_s < 1):  # fmt: skip
        raise DistributedConfigError(
            f"--heartbeat-timeout {heartbeat_timeout_s!r} must be >= 1 (whole seconds); give the "
            f"seconds without a heartbeat after which a peer counts as dead, e.g. "
            f"--heartbeat-timeout {HEARTBEAT_TIMEOUT_S}"
        )
    spec = MeshSpec.of(mesh) if mesh else None
    group = resolve_process_group(coordinator, num_processes, process_id, env)
    if group is None:
        return None
    cpu_devices = None
    if cpu_only():
        fixed = spec is not None and -1 not in spec.sizes.values()
        cpu_devices = devices_per_process(group, devices, spec.size if fixed else None)
    initialize(group, cpu_devices, heartbeat_timeout_s)
    return JoinedRun(group, cpu_devices, heartbeat_timeout_s)
