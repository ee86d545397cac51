"""Everything a worker learns from its environment, read in this one place.

Under ``ringtrain train`` and under plain ``torchrun`` the elastic agent sets ``RANK``, ``WORLD_SIZE`` and
friends. Started by hand with none of them, a worker is a world of one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ringtrain.group.auth import SECRET_FILE_VAR, SECRET_VAR, JobSecret, load_job_secret

__all__ = ["DistEnv", "BIND_ADDR_VAR", "LAUNCHER_VAR", "JOB_STORE_VAR", "SET_VAR", "RUN_DIR_VAR", "RESUME_VAR",
           "HEAL_VAR", "HEAL_JOIN_VAR", "FAULT_PLAN_VAR", "FAULT_PLAN_ARMED_VAR", "ERROR_FILE_VAR", "forget_fault_plan",
           "cluster_environ", "remote_environ"]

# Both set by `ringtrain train`, never by torchrun.
BIND_ADDR_VAR = "RINGTRAIN_BIND_ADDR"
"""The address this host's listening sockets must bind to."""
LAUNCHER_VAR = "RINGTRAIN_LAUNCHER"
"""Present when `ringtrain train` started the worker (it then reports worker errors itself)."""
JOB_STORE_VAR = "RINGTRAIN_JOB_STORE"
"""HOST:PORT of the launcher's rendezvous store, which outlives every worker (progress, heartbeats)."""
HEAL_VAR = "RINGTRAIN_HEAL_MIN_WORKERS"
"""`--heal`: 'MIN:MAX', the fewest workers healing keeps the job at and the most it admits (joiners)."""
HEAL_JOIN_VAR = "RINGTRAIN_HEAL_JOIN"
"""Set by `ringtrain join RUN_DIR` for a --heal job: this worker asks to be admitted at a step boundary."""

# Set by a test harness only (ringtrain/testing/faults.py), for the job it launches; never inherited further.
FAULT_PLAN_VAR = "RINGTRAIN_FAULT_PLAN"
"""The path of a test's fault plan: the worker arms it (train/build.py) and drops the variable from its own
environment; `ringtrain join` drops it too, so a joiner is never armed."""
FAULT_PLAN_ARMED_VAR = "RINGTRAIN_FAULT_PLAN_ARMED"
"""The test's opt-in beside the plan (`i-am-a-test-` and the plan's own random value): without it a plan is
ignored with a warning, so a RINGTRAIN_FAULT_PLAN a production environment inherits arms nothing."""

# Set by `ringtrain run SCRIPT` for the script's ringtrain.fit (the script's own argv belongs to the user); a
# user sets RINGTRAIN_RUN_DIR and RINGTRAIN_RESUME under python or torchrun too (docs/ways-in.md, "Your own model and data").
SET_VAR = "RINGTRAIN_SET"
"""The --set overrides, a JSON list of 'section.field=value' strings."""
RUN_DIR_VAR = "RINGTRAIN_RUN_DIR"
"""--run-dir: overrides the run directory the script's config (or fit(run_dir=...)) names."""
RESUME_VAR = "RINGTRAIN_RESUME"
"""'resume' (--resume: continue the run directory's newest valid checkpoint), 'from:PATH' (--resume-from PATH),
'checked' (set by `ringtrain run`: the launcher checked the run directory: continue a checkpoint there if any),
or unset (a fresh run, unless fit(resume=...) asks: refuse a run directory with checkpoints)."""
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
"""Set by torch's elastic agent (ringtrain's launcher, torchrun): where a worker records why it failed."""


@dataclass(frozen=True)
class DistEnv:
    """Rank, sizes and rendezvous details of this worker process."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    """How many times the elastic agent has restarted this job's workers (0 on the first attempt)."""
    use_agent_store: bool = False
    """True when torchrun shares its rendezvous TCPStore with workers (they must connect as clients)."""
    bind_addr: str | None = None
    """Address to bind listening sockets to; None leaves the choice to torch (plain torchrun)."""
    run_id: str | None = None
    launched_by_ringtrain: bool = False
    job_store: str | None = None
    """HOST:PORT of a store that outlives the workers: the launcher's, or torchrun's shared agent store."""
    overrides: tuple[str, ...] = ()
    """`ringtrain run --set ...`: overrides of the config a script passes to ringtrain.fit."""
    run_dir: str | None = None
    """`ringtrain run --run-dir`: overrides the script's run directory."""
    resume: str | None = None
    """`ringtrain run`'s resume request (see RESUME_VAR)."""
    heal_min_workers: int | None = None
    """`--heal`: the fewest workers a healed job may continue with (None: not launched with --heal)."""
    heal_max_workers: int | None = None
    """`--heal`: the most workers the job admits (``ringtrain join`` brings it back up to this)."""
    heal_join: bool = False
    """`ringtrain join` of a --heal job: admitted by the running workers, no rendezvous (heal/membership.py)."""
    fault_plan: str | None = None
    """A test harness's fault plan (FAULT_PLAN_VAR), armed by build_trainer; None in every user's run."""
    fault_plan_opt_in: str | None = None
    """The harness's opt-in beside it (FAULT_PLAN_ARMED_VAR): the plan is armed only when it matches the plan's."""
    error_file: str | None = None
    """Where the elastic agent reads why this worker failed (ERROR_FILE_VAR); None without an agent."""
    job_secret: JobSecret | None = None
    """The job's secret (group/auth.py: RINGTRAIN_JOB_SECRET or RINGTRAIN_JOB_SECRET_FILE): seals the workers' and
    the job's stores; None under plain torchrun without one."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        run_options = {
            "overrides": tuple(json.loads(env[SET_VAR])) if env.get(SET_VAR) else (),
            "run_dir": env.get(RUN_DIR_VAR) or None,
            "resume": env.get(RESUME_VAR) or None,
            "heal_min_workers": int(env[HEAL_VAR].split(":")[0]) if env.get(HEAL_VAR) else None,
            "heal_max_workers": int(env[HEAL_VAR].split(":")[-1]) if env.get(HEAL_VAR) else None,
            "heal_join": HEAL_JOIN_VAR in env,
            "fault_plan": env.get(FAULT_PLAN_VAR) or None,
            "fault_plan_opt_in": env.get(FAULT_PLAN_ARMED_VAR) or None,
            "error_file": env.get(ERROR_FILE_VAR) or None,
            "job_secret": load_job_secret(env),
        }
        if "RANK" not in env:
            # A worker joining a --heal job gets its rank when admitted; it reaches the job store now.
            return cls(bind_addr=env.get(BIND_ADDR_VAR), launched_by_ringtrain=LAUNCHER_VAR in env,
                       job_store=env.get(JOB_STORE_VAR) or None, run_id=env.get("TORCHELASTIC_RUN_ID"), **run_options)
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            world_size=int(env["WORLD_SIZE"]),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=env.get("MASTER_ADDR"),
            master_port=int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None,
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "False").lower() == "true",
            bind_addr=env.get(BIND_ADDR_VAR),
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            launched_by_ringtrain=LAUNCHER_VAR in env,
            job_store=env.get(JOB_STORE_VAR) or _agent_store(env),
            **run_options,
        )

    @property
    def is_distributed(self) -> bool:
        return self.master_addr is not None

    @property
    def is_restart(self) -> bool:
        """The elastic agent restarted the workers: the run must resume from its last checkpoint."""
        return self.restart_count > 0


def forget_fault_plan(environ: MutableMapping[str, str] | None = None) -> None:
    """Take the fault plan out of ``environ`` (default: this process's environment), so that no process
    started from it is armed: the armed worker's children, a `ringtrain join` worker."""
    env = os.environ if environ is None else environ
    env.pop(FAULT_PLAN_VAR, None)
    env.pop(FAULT_PLAN_ARMED_VAR, None)


def _agent_store(env: Mapping[str, str]) -> str | None:
    """Plain torchrun shares its rendezvous store with the workers; it outlives them too."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "False").lower() != "true" or "MASTER_PORT" not in env:
        return None
    return f"{env.get('MASTER_ADDR', '127.0.0.1')}:{env['MASTER_PORT']}"


_CLUSTER_VARS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "RINGTRAIN_CLUSTER")
"""Besides every SLURM_* and PET_* variable: what a scheduler tells a launcher (ringtrain/cluster.py)."""


def cluster_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's view of its scheduler: SLURM's and PyTorchJob's variables (``cluster.fill_launch_flags``)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(("SLURM_", "PET_")) or k in _CLUSTER_VARS}


_REMOTE_VARS = ("PYTHONPATH", "OMP_NUM_THREADS")
_NOT_REMOTE = (BIND_ADDR_VAR, LAUNCHER_VAR, JOB_STORE_VAR, HEAL_VAR, HEAL_JOIN_VAR, FAULT_PLAN_VAR,
               FAULT_PLAN_ARMED_VAR, SECRET_VAR, SECRET_FILE_VAR)
"""Never on an ssh command line: what a launcher sets for its own workers, a test's fault plan, and the job's
secret (hostfile.py hands that to each host over the ssh channel's stdin)."""


def remote_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a --hostfile launch sends to each host's launcher over ssh (which carries no environment):
    PYTHONPATH, OMP_NUM_THREADS and the user's RINGTRAIN_* variables; never the ones a launcher sets for its
    workers, nor a test's fault plan (ringtrain/hostfile.py)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items()
            if (k in _REMOTE_VARS or k.startswith("RINGTRAIN_")) and k not in _NOT_REMOTE}
